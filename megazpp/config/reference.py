"""`pretrain_gpt.py --help` and `docs/flags.md`, both generated from the config schema.

Why generated: the flags are the sections' fields (`megazpp.config.schema.flag_table`), so a
hand-written reference would drift from them. Each field's one line of help is written beside
it, in the section's own class (`megazpp.setting.setting`; a test requires a line for every
key); this module renders the same table twice: as console text and as Markdown.
`python -m megazpp.config.reference` rewrites docs/flags.md; a test checks the committed file is what it would write.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megazpp.config.aliases import MEGATRON_ALIASES, REFUSED_FLAGS
from megazpp.config.load import file_defaults
from megazpp.config.schema import FLAG_NAMES, SECTIONS, Config, flag_table
from megazpp.setting import help_of, keys

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "flags.md"

SECTION_HELP: dict[str, str] = {
    "model": "shape and behaviour of the GPT-2 / Llama model",
    "data": "indexed dataset, blend, split and tokenizer",
    "optimizer": "the inner optimizer (AdamW or SGD) and gradient clipping",
    "training": "batch sizes, run length, learning-rate schedule, evaluation, numerics",
    "precision": "model dtype, gradient accumulation dtype, fp16 loss scaling",
    "checkpoint": "where checkpoints go and come from",
    "logging": "console and TensorBoard",
    "parallel": "tensor / pipeline parallel layout and process groups",
    "zero": "the data-parallel optimizer: ZeRO stage or PaRO strategy, ZeRO++, LoCo",
    "planner": "cluster facts for `zero.paro_strategy: auto` and `zero.hierarchical: auto`",
    "outer": "two-level training: ZeRO inside islands of nodes, DiLoCo outer steps across them (docs/arch/outer.md)",
}

FILE_FLAGS = (
    ("--config FILE", "YAML config (sections as below); flags override it"),
    ("--deepspeed_config FILE", "DeepSpeed JSON (zero_optimization, fp16, bf16, optimizer, ...)"),
)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return "{" + ",".join(str(c) for c in typing.get_args(hint)) + "}"
    if origin is list:
        return str(typing.get_args(hint)[0].__name__) + " ..."
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return _type_name(args[0])
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field[object]) -> str:
    """A field's declared default (not a derived value: ffn_hidden_size's none stays none)."""
    if f.default is not dataclasses.MISSING:
        return _shown(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _shown(f.default_factory())
    return "required"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "[]"
    return str(value)


def reference_rows(
    shown: Config | None = None,
    origins: dict[str, str] | None = None,
) -> dict[str, list[tuple[str, str, str, str]]]:
    """section -> [(flag, type, default, help)] in schema order. The default is the built-in
    value, or `shown`'s where `origins` says a file set it (then with the built-in beside it)."""
    table = flag_table()
    by_field = {v: k for k, v in table.items()}
    shown = shown or Config()
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in keys(cls):
            flag = by_field[(section, f.name)]
            kind = "" if hints[f.name] is bool else _type_name(hints[f.name])
            flags = f"{flag} / --no-{flag[2:]}" if hints[f.name] is bool else flag
            default = _default(f)
            source = (origins or {}).get(f"{section}.{f.name}")
            if source is not None:
                default = (
                    f"{_shown(getattr(getattr(shown, section), f.name))} from the "
                    f"{source.split(' ', 1)[0]} file; built-in {default}"
                )
            rows.setdefault(section, []).append((flags, kind, default, help_of(f)))
    return rows


def _alias_lines() -> list[tuple[str, str]]:
    lines = []
    for alias, target in MEGATRON_ALIASES.items():
        lines.append((alias, "= " + (target if isinstance(target, str) else " ".join(target))))
    for flag, why in REFUSED_FLAGS.items():
        lines.append((flag, "refused: " + why))
    return lines


def render_help(argv: Sequence[str] = ()) -> str:
    """The console text of `pretrain_gpt.py --help`: with `--config` / `--deepspeed_config` in
    `argv` (run.sh passes its CONFIG), the defaults those files set, as the command would run."""
    shown, origins = file_defaults(argv)
    files = list(dict.fromkeys(source for source in origins.values()))
    out = [
        "usage: pretrain_gpt.py [--config FILE] [--deepspeed_config FILE] [--FLAG VALUE ...]",
        "",
        "Pretrain a GPT-2 or Llama model. Precedence: defaults < --config < --deepspeed_config < flags.",
        "Every config key is a flag: section.some_key is "
        "--some-key (except " + ", ".join(f"{k} {v}" for k, v in FLAG_NAMES.items()) + ").",
        "Defaults shown: "
        + (
            " over ".join(reversed(files)) + " over the built-in values"
            if files
            else "the built-in values (no --config given)"
        )
        + ".",
        "",
        "files:",
    ]
    out += [f"  {flag:<34} {text}" for flag, text in FILE_FLAGS]
    for section, rows in reference_rows(shown, origins).items():
        out += ["", f"{section}: {SECTION_HELP.get(section, '')}"]
        for flag, kind, default, text in rows:
            left = f"{flag} {kind}".rstrip()
            out.append(f"  {left:<34} {text} (default: {default})")
    out += ["", "Megatron-LM spellings:"]
    out += [f"  {flag:<34} {text}" for flag, text in _alias_lines()]
    return "\n".join(out) + "\n"


def render_markdown() -> str:
    """docs/flags.md."""
    out = [
        "# Flag reference",
        "",
        "Generated from the config schema by `python -m megazpp.config.reference` (do not "
        "edit by hand; a test checks it is current). `pretrain_gpt.py --help` prints the "
        "same. Precedence: defaults < `--config` YAML < `--deepspeed_config` JSON < flags. "
        "A YAML key is the flag's field name under its section (`--micro-batch-size` is "
        "`training: {micro_batch_size: ...}`).",
        "",
        "| file flag | meaning |",
        "|---|---|",
    ]
    out += [f"| `{flag}` | {text} |" for flag, text in FILE_FLAGS]
    for section, rows in reference_rows().items():
        out += [
            "",
            f"## {section}",
            "",
            SECTION_HELP.get(section, "") + ".",
            "",
            "| flag | type | default | meaning |",
            "|---|---|---|---|",
        ]
        out += [f"| `{flag}` | {kind.replace('|', '/')} | {default} | {text} |" for flag, kind, default, text in rows]
    out += ["", "## Megatron-LM spellings", "", "| Megatron flag | megazpp |", "|---|---|"]
    out += [f"| `{flag}` | {text} |" for flag, text in _alias_lines()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    DOC_PATH.write_text(render_markdown())
    print(f"wrote {DOC_PATH}", file=sys.stderr)
