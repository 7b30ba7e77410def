"""Reading the Config from its sources: `--config FILE` (YAML), `--deepspeed_config FILE`
and Megatron-style flags, in that order of precedence over the dataclass defaults.

Why apart from the schema: the sections are data every part reads; how a value arrives (a
file, a flag, a Megatron alias, a negative number after a flag) is this module's job alone.
"""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from megazpp.config.aliases import MEGATRON_ALIASES, translate_megatron_flags
from megazpp.config.schema import SECTIONS, Config, flag_table
from megazpp.config.sections import TrainingOptions
from megazpp.config.values import coerce, suggest
from megazpp.data.options import DataOptions
from megazpp.errors import ConfigError, MegazppError
from megazpp.parallel.options import ParallelOptions
from megazpp.setting import keys
from megazpp.unique_keys import load_yaml


def load_config(argv: Sequence[str] | None = None, notes: list[str] | None = None) -> Config:
    """Build the Config from `--config FILE`, `--deepspeed_config FILE` and flags in `argv`.

    Validation against the world size happens separately (`config.checks.validate_config`), since the
    launcher decides the world; everything that does not depend on it is checked here.
    Values the loader adjusted (see `_fit_warmup_to_run`) are described in `notes`.
    """
    args = list(argv or [])
    yaml_path, ds_path, flag_args = _split_file_flags(args)
    values, origins = _read_files(yaml_path, ds_path)
    from_files = dict(values["training"])
    _merge(values, origins, _parse_flags(flag_args), source="command line")
    _fit_warmup_to_run(values["training"], from_files, origins, notes if notes is not None else [])
    return _build(values, origins, derive_vocab="vocab_size" not in values["model"])


def file_defaults(argv: Sequence[str]) -> tuple[Config, dict[str, str]]:
    """What `--help` shows as each flag's default for a command: the built-in values under the
    `--config` and `--deepspeed_config` files `argv` names, and which file set each
    (`section.field` -> source). Nothing is derived from data (the tokenizer may not exist yet)."""
    yaml_path, ds_path, _ = _split_file_flags(list(argv))
    values, origins = _read_files(yaml_path, ds_path)
    return _build(values, origins), origins


def _read_files(yaml_path: str | None, ds_path: str | None) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The sections' values from the YAML, then the DeepSpeed JSON over it, and their origins."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    origins: dict[str, str] = {}
    if yaml_path is not None:
        _merge(values, origins, _read_yaml(yaml_path), source=f"config file {yaml_path}")
    if ds_path is not None:
        from megazpp.config.deepspeed import read_deepspeed_config

        names: dict[str, str] = {}
        sections = read_deepspeed_config(ds_path, names)
        _merge(values, origins, sections, source=f"DeepSpeed config {ds_path}", spelled=names)
    return values, origins


def _fit_warmup_to_run(
    t: dict[str, Any], from_files: dict[str, Any], origins: dict[str, str], notes: list[str]
) -> None:
    """A quick try such as `--train-iters 10` on a config file written for a longer run keeps
    the file's warmup as the same share of the (shorter) run: warmup x this run's decay length
    / the file's, rounded down, so the warmup grows with the run up to the file's own at the
    file's length (never a jump from a scaled 2 steps at 29 to the file's 30 at 30). A warmup
    given on the command line, or a run as long as the file's or longer, is never changed.
    `t`: the training section's values before it is built (the section is checked once, with
    the warmup it will keep)."""
    source = origins.get("training.lr_warmup_iters")
    if source in (None, "command line"):
        return
    default = TrainingOptions.train_iters
    warmup = int(t["lr_warmup_iters"])
    decay = int(t.get("lr_decay_iters") or t.get("train_iters") or default)
    file_decay = int(from_files.get("lr_decay_iters") or from_files.get("train_iters") or default)
    if decay >= file_decay or warmup > file_decay:
        return  # a longer run keeps the warmup; a file contradicting itself is refused when built
    adjusted = warmup * decay // file_decay
    if adjusted == warmup:
        return
    notes.append(
        f"training.lr_warmup_iters = {warmup} ({source}) is for its "
        f"{file_decay} steps: using {adjusted} for this run's {decay}, the same share "
        f"({warmup}/{file_decay}); give --lr-warmup-iters to choose"
    )
    t["lr_warmup_iters"] = adjusted


def _split_file_flags(args: list[str]) -> tuple[str | None, str | None, list[str]]:
    parser = _RaisingParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config")
    known, rest = parser.parse_known_args(args)
    return known.config, known.deepspeed_config, rest


class _RaisingParser(argparse.ArgumentParser):
    """argparse exits the process on a bad flag; the project raises ConfigError instead."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"command line: {message}")


def _read_yaml(path: str) -> dict[str, dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({exc})") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of sections {sorted(SECTIONS)}, got {type(raw).__name__}"
        )
    from megazpp.config.deepspeed import is_deepspeed_key

    deepspeed = [str(key) for key in raw if key not in SECTIONS and is_deepspeed_key(key)]
    if deepspeed:
        raise ConfigError(
            f"config file {path}: this is a DeepSpeed config (its keys are DeepSpeed's: "
            f"{', '.join(deepspeed[:3])}{', ...' if len(deepspeed) > 3 else ''}), not "
            "a megazpp YAML: pass it as --deepspeed_config " + path + " (with run.sh: "
            "bash run.sh --deepspeed_config " + path + "; CONFIG names the YAML it "
            "overrides)"
        )
    sections: dict[str, dict[str, Any]] = {}
    for name, body in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"config file {path}: unknown section {name!r}{suggest(str(name), SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"config file {path}: section {name!r} must be a mapping, got {type(body).__name__}")
        sections[name] = body
    return sections


def _merge(
    values: dict[str, dict[str, Any]],
    origins: dict[str, str],
    update: dict[str, dict[str, Any]],
    source: str,
    spelled: dict[str, str] | None = None,
) -> None:
    """Type-check each key of `update` against its section and write it into `values`,
    remembering in `origins` which source set it (for error messages). `spelled` spells a key
    as its source wrote it (a DeepSpeed key: `train_batch_size`, not `training.global_batch_size`)."""
    for section, body in update.items():
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        names = {f.name for f in keys(cls)}
        for key, value in body.items():
            if key not in names:
                raise ConfigError(f"{source}: unknown key {section}.{key}{_suggest_key(section, str(key))}")
            name = (spelled or {}).get(f"{section}.{key}", f"{section}.{key}")
            values[section][key] = coerce(value, hints[key], f"{source}: {name}")
            origins[f"{section}.{key}"] = source


def _suggest_key(section: str, key: str) -> str:
    for other, cls in SECTIONS.items():
        if other != section and key in {f.name for f in keys(cls)}:
            return f" (it belongs in section {other!r})"
    return suggest(key, [f.name for f in keys(SECTIONS[section])])


def _parse_flags(args: list[str]) -> dict[str, dict[str, Any]]:
    table = flag_table()
    args = translate_megatron_flags(args)
    parser = _RaisingParser(add_help=False, allow_abbrev=False)
    for flag, (section, name) in table.items():
        hint = typing.get_type_hints(SECTIONS[section])[name]
        dest = f"{section}.{name}"
        if hint is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif typing.get_origin(hint) is list:
            parser.add_argument(flag, dest=dest, nargs="+", default=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS)
    valued = {
        flag
        for flag, (section, name) in table.items()
        if typing.get_type_hints(SECTIONS[section])[name] is not bool
        and typing.get_origin(typing.get_type_hints(SECTIONS[section])[name]) is not list
    }
    known, unknown = parser.parse_known_args(_attach_negative_numbers(args, valued))
    if unknown:
        bad = unknown[0]
        if bad.startswith("-"):
            name = bad.split("=", 1)[0]
            flags = (
                list(table)
                + list(MEGATRON_ALIASES)
                + [f"--no-{f[2:]}" for f, (s, n) in table.items() if typing.get_type_hints(SECTIONS[s])[n] is bool]
            )
            raise ConfigError(f"command line: unknown flag {name}{suggest(name, flags)}")
        raise ConfigError(f"command line: unexpected argument {bad!r}")
    update: dict[str, dict[str, Any]] = {}
    for dest, value in vars(known).items():
        section, name = dest.split(".", 1)
        update.setdefault(section, {})[name] = value
    return update


def _attach_negative_numbers(args: list[str], valued: set[str]) -> list[str]:
    """`--lr -1e-3` as `--lr=-1e-3`: argparse takes a word starting with `-` for a flag unless
    it looks like `-1` or `-.5` (not `-1e-3`), and then says the flag "expected one argument";
    the value then meets its own check (a negative --lr: config.checks)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in valued and i + 1 < len(args) and _is_negative_number(args[i + 1]):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def _is_negative_number(word: str) -> bool:
    """`-1e-3`, `-.5`, `-1,2` (a split): a value, since no flag starts with a dash and a digit."""
    return re.match(r"-\.?\d", word) is not None


def _build(values: dict[str, dict[str, Any]], origins: dict[str, str], derive_vocab: bool | None = None) -> Config:
    """Each section built once from its values: its constructor checks it (a subsystem's section
    refuses what that subsystem cannot run), and a refusal naming a key says where it was set.
    The model is built last: with `derive_vocab` true its vocabulary is sized from the data
    section's tokenizer, false checks a given size against it (`_vocab_size`), None does neither
    (`--help`'s defaults: the tokenizer may not exist yet); no section is changed once built."""
    sections: dict[str, Any] = {}
    for name in sorted(SECTIONS, key=lambda n: n == "model"):
        given = values[name]
        if name == "model" and derive_vocab is not None:
            given = {**given, **_vocab_size(sections["data"], sections["parallel"], given, derive_vocab)}
        try:
            sections[name] = SECTIONS[name](**given)
        except ConfigError as err:
            key = re.match(r"[a-z_]+\.[a-z0-9_]+", str(err))
            source = origins.get(key[0]) if key else None
            if source is None or str(err).startswith(source):
                raise
            raise ConfigError(f"{source}: {err}") from None
        except MegazppError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"section {name!r}: {exc}") from exc
    return Config(**sections)


def _vocab_size(data: DataOptions, parallel: ParallelOptions, model: dict[str, Any], derive: bool) -> dict[str, int]:
    """The model's vocabulary sized from the tokenizer (padded to the data section's multiple x
    tp) when `derive`; else an explicit size checked to cover it. Empty without a tokenizer."""
    if data.tokenizer_model is None or data.make_vocab_size_divisible_by < 1:
        return {}  # a multiple below 1 is refused, naming the key, by DataOptions
    from megazpp.data.tokenizer import Tokenizer

    tokenizer_vocab = Tokenizer(data.tokenizer_model).vocab_size
    if not derive:
        if model["vocab_size"] < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size = {model['vocab_size']} is smaller than the vocabulary of "
                f"data.tokenizer_model {data.tokenizer_model} ({tokenizer_vocab} tokens)"
            )
        return {}
    multiple = data.make_vocab_size_divisible_by * parallel.tensor_model_parallel_size
    return {"vocab_size": -(-tokenizer_vocab // multiple) * multiple}


def validate_types(cfg: Config) -> None:
    """Values set in code (tests, tools) get the same type checks as YAML and flags."""
    for section in SECTIONS:
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        for f in keys(obj):
            coerce(getattr(obj, f.name), hints[f.name], f"{section}.{f.name}")
