"""The comparison as Markdown: one row per run, the notes, and the settings that differ.

Why the config differences: a table of losses says which run did better, not what made the
runs different; the resolved configs the trainer logged answer that without opening YAML.
"""

from __future__ import annotations

from collections.abc import Sequence

from megazpp.analysis.comparison import THROUGHPUT_CAVEAT, Comparison, RunSummary
from megazpp.analysis.event_reader import Run
from megazpp.analysis.hparams import hparams_from_config

NA = "n/a"


def format_bytes(value: float | None) -> str:
    if value is None:
        return NA
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    exponent = 0
    while abs(value) >= 1024 and exponent < len(units) - 1:
        value /= 1024
        exponent += 1
    return f"{value:.0f} B" if exponent == 0 else f"{value:.2f} {units[exponent]}"


def format_loss(value: float | None) -> str:
    return NA if value is None else f"{value:.4f}"


def render_markdown(comparison: Comparison) -> str:
    """The whole summary.md text."""
    lines = ["# Run comparison", ""]
    lines += [f"- **{run.label}**: `{run.directory}`" for run in comparison.runs]
    if comparison.step_range:
        first, last = comparison.step_range
        lines += [
            "",
            f"The columns use the common training steps {first}..{last} (the steps every run "
            "logged), except the last two: each run's own last step and final train loss.",
        ]
    lines += ["", *_table(comparison.summaries, comparison.runs[0].label), "", THROUGHPUT_CAVEAT]
    if comparison.notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in comparison.notes]]
    lines += ["", *_config_differences(comparison.runs)]
    return "\n".join(lines).rstrip() + "\n"


def _table(rows: Sequence[RunSummary], reference: str) -> list[str]:
    header = [
        "run",
        "final step",
        "final train loss",
        "best train loss",
        "final val loss",
        "best val loss",
        f"gap to {reference}",
        "tokens/s (mean)",
        "inter-node bytes/step (mean)",
        "peak memory",
        "own last step",
        "own final train loss",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(rows):
        gap = NA if row.gap is None else ("reference" if i == 0 else f"{row.gap:+.4f}")
        cells = [
            row.label,
            NA if row.final_step is None else str(row.final_step),
            format_loss(row.final_loss),
            format_loss(row.best_loss),
            format_loss(row.final_val_loss),
            format_loss(row.best_val_loss),
            gap,
            NA if row.tokens_per_sec is None else f"{row.tokens_per_sec:,.1f}",
            format_bytes(row.inter_bytes_per_step),
            format_bytes(row.peak_memory_bytes),
            NA if row.own_last_step is None else str(row.own_last_step),
            format_loss(row.own_final_loss),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _config_differences(runs: Sequence[Run]) -> list[str]:
    lines = ["## Config differences", ""]
    missing = [run.label for run in runs if run.config is None]
    if missing:
        lines.append(f"No readable logged config for: {', '.join(missing)}.")
    flat = [hparams_from_config(run.config) for run in runs if run.config is not None]
    labels = [run.label for run in runs if run.config is not None]
    if len(flat) < 2:
        return lines if missing else []
    keys = sorted({key for f in flat for key in f})
    differing = [key for key in keys if len({repr(f.get(key)) for f in flat}) > 1]
    if not differing:
        lines.append(f"The logged configs of {', '.join(labels)} are identical.")
        return lines
    lines += ["| key | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for key in differing:
        lines.append(f"| {key} | " + " | ".join(f"`{f[key]}`" if key in f else "unset" for f in flat) + " |")
    return lines
