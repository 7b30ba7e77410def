"""From run directories to the three comparison files (loss.png, throughput.png,
summary.md): the library behind `tools/compare_runs.py`, callable from other tools (the
LoCo experiment, the network benchmark) without a subprocess."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from megazpp.analysis.comparison import TRAIN_LOSS, Comparison, compare_runs
from megazpp.analysis.event_reader import read_runs
from megazpp.analysis.report import format_loss, render_markdown
from megazpp.analysis.smoothing import auto_weight, check_weight
from megazpp.errors import ConfigError

LOSS_PNG, THROUGHPUT_PNG, SUMMARY_MD = "loss.png", "throughput.png", "summary.md"


@dataclass(frozen=True)
class ComparisonFiles:
    comparison: Comparison
    loss_png: Path
    throughput_png: Path
    summary_md: Path
    smoothing: float  # the EMA weight of loss.png's smoothed curves


def compare_directories(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    smoothing: float | None = None,
    labels: Sequence[str] | None = None,
) -> ComparisonFiles:
    """Read every run, compare them (the first is the reference), write the three files.

    Every run is read before anything is written, so a bad run directory costs no output.
    `smoothing` None adapts the weight to the shortest training-loss curve (`auto_weight`).
    A directory holding several runs is split into them, and a note says so.
    """
    if not run_dirs:
        raise ConfigError("no run directories given (expected at least one RUN_DIR)")
    if smoothing is not None:
        check_weight(smoothing)
    names = _labels(run_dirs, labels)
    per_dir = [read_runs(d, name) for d, name in zip(run_dirs, names)]
    comparison = compare_runs([run for runs in per_dir for run in runs])
    for d, runs in zip(run_dirs, per_dir):
        if len(runs) > 1:
            comparison.notes.append(
                f"{d} holds {len(runs)} runs with different configs (TensorBoard shows them "
                f"merged into one curve); compared separately as "
                f"{', '.join(run.label for run in runs)}"
            )
    if smoothing is None:
        lengths = [len(run.scalars[TRAIN_LOSS]) for run in comparison.runs if TRAIN_LOSS in run.scalars]
        smoothing = auto_weight(min(lengths, default=0))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    from megazpp.analysis.plots import plot_loss, plot_throughput

    files = ComparisonFiles(comparison, out / LOSS_PNG, out / THROUGHPUT_PNG, out / SUMMARY_MD, smoothing)
    plot_loss(comparison, files.loss_png, smoothing)
    plot_throughput(comparison, files.throughput_png)
    _write_text(files.summary_md, render_markdown(comparison))
    return files


def closing_line(files: ComparisonFiles) -> str:
    """One line for the console: how many runs, on which steps, who ended lowest."""
    comparison = files.comparison
    steps = (
        f"steps {comparison.step_range[0]}..{comparison.step_range[1]}"
        if comparison.step_range
        else "their whole lengths"
    )
    ranked = [row for row in comparison.summaries if row.final_loss is not None]
    best = min(ranked, key=lambda row: cast(float, row.final_loss), default=None)  # ranked: rows with a loss
    lowest = (
        f"lowest final train loss {best.label} {format_loss(best.final_loss)}" if best else "no run has a training loss"
    )
    notes = f"{len(comparison.notes)} note(s)" if comparison.notes else "no notes"
    return (
        f"compared {len(comparison.runs)} run(s) on {steps}: {lowest}; {notes}; "
        f"smoothing {files.smoothing:.2g}; wrote {files.loss_png}, {files.throughput_png}, "
        f"{files.summary_md}"
    )


def _labels(run_dirs: Sequence[str | Path], labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(run_dirs):
            raise ConfigError(
                f"--labels has {len(labels)} name(s) for {len(run_dirs)} run "
                f"directories (expected one label per RUN_DIR)"
            )
        if len(set(labels)) != len(labels) or not all(labels):
            raise ConfigError(f"--labels {','.join(labels)} must be distinct and non-empty")
        return list(labels)
    names = [Path(d).resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
