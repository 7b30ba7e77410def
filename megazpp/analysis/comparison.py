"""Aligns runs by step and reduces each to the numbers a comparison table needs.

Why one common step range for the columns: a run that stopped at step 50 has a higher
"final" loss than one that went on to 100 for no reason but its length, and its mean
tokens/s misses the later steps. The compared numbers are therefore taken over the steps all
runs with a training loss share, and the notes say so whenever the runs differ in length.
Each run's own last step and final loss stand beside them (a 300-step run's result is what
its user came for, even next to a 20-step try).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from megazpp.analysis.event_reader import Run, Series
from megazpp.errors import DataError

TRAIN_LOSS = "train/loss"
VAL_LOSS = "val/loss"
TOKENS_PER_SEC = "perf/tokens_per_sec"
INTER_BYTES = "comm/inter_bytes"
PEAK_MEMORY = "mem/peak_bytes"
COMPARED_TAGS = (TRAIN_LOSS, VAL_LOSS, TOKENS_PER_SEC, INTER_BYTES, PEAK_MEMORY)
# tokens/s is a wall-clock rate: another job on the same cores or GPUs slows a run down
THROUGHPUT_CAVEAT = (
    "tokens/s depends on the machine's load while each run ran (other jobs on the "
    "same cores or GPUs slow it): compare it only between runs made alone on the "
    "same machine."
)


@dataclass(frozen=True)
class RunSummary:
    """One table row; None where the run lacks the tag (or has no point in the range)."""

    label: str
    final_step: int | None
    final_loss: float | None
    best_loss: float | None
    final_val_loss: float | None
    best_val_loss: float | None
    gap: float | None
    tokens_per_sec: float | None
    inter_bytes_per_step: float | None
    peak_memory_bytes: float | None
    own_last_step: int | None = None  # the run's own last training step, outside the common range too
    own_final_loss: float | None = None


@dataclass(frozen=True)
class Comparison:
    runs: list[Run]
    summaries: list[RunSummary]
    step_range: tuple[int, int] | None
    notes: list[str]


def compare_runs(runs: Sequence[Run]) -> Comparison:
    """Summarise `runs` over their common training steps; the first run is the reference
    that every gap is measured against (gap = final loss - reference's final loss)."""
    if not runs:
        raise DataError("no runs to compare (give at least one run directory)")
    notes = [
        _lacking_note([run.label for run in runs if not _has(run, tag)], tag)
        for tag in COMPARED_TAGS
        if not all(_has(run, tag) for run in runs)
    ]
    step_range = _common_steps(runs, notes)
    first, last = step_range if step_range else (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
    clipped = [{tag: s.within(first, last) for tag, s in run.scalars.items()} for run in runs]
    if step_range:
        notes += [
            f"run {run.label} has no {tag} point in steps {first}..{last}"
            for run, scalars in zip(runs, clipped)
            for tag in COMPARED_TAGS
            if _has(run, tag) and not len(scalars[tag])
        ]
    rows = [_with_own_end(_summarise(run.label, scalars), run) for run, scalars in zip(runs, clipped)]
    rows = _with_gaps(rows, notes)
    final_steps = {r.final_step for r in rows if r.final_step is not None}
    if len(final_steps) > 1:
        at = ", ".join(f"{r.label}: {r.final_step}" for r in rows if r.final_step is not None)
        notes.append(f"the runs log at different steps, so final losses are from different steps ({at})")
    return Comparison(list(runs), rows, step_range, notes)


def _has(run: Run, tag: str) -> bool:
    return tag in run.scalars and len(run.scalars[tag]) > 0


def _lacking_note(labels: list[str], tag: str) -> str:
    if len(labels) == 1:
        return f"run {labels[0]} has no {tag}"
    return f"runs {', '.join(labels)} have no {tag}"


def _common_steps(runs: Sequence[Run], notes: list[str]) -> tuple[int, int] | None:
    trains = {run.label: run.scalars[TRAIN_LOSS] for run in runs if _has(run, TRAIN_LOSS)}
    spans = {label: (int(s.steps[0]), int(s.steps[-1])) for label, s in trains.items()}
    if not spans:
        notes.append(f"no run has {TRAIN_LOSS}: every column uses each run's whole length")
        return None
    first = max(lo for lo, _ in spans.values())
    last = min(hi for _, hi in spans.values())
    listed = ", ".join(f"{label}: steps {lo}..{hi}" for label, (lo, hi) in spans.items())
    if first > last:
        raise DataError(f"the runs share no {TRAIN_LOSS} steps ({listed}); compare runs whose training steps overlap")
    if len(set(spans.values())) > 1:
        notes.append(f"the runs differ in length ({listed}); every column uses the common steps {first}..{last}")
    return first, last


def _summarise(label: str, scalars: dict[str, Series]) -> RunSummary:
    def values(tag: str) -> np.ndarray | None:
        series = scalars.get(tag)
        return series.values if series is not None and len(series) else None

    train, val = values(TRAIN_LOSS), values(VAL_LOSS)
    tokens, inter, memory = values(TOKENS_PER_SEC), values(INTER_BYTES), values(PEAK_MEMORY)
    return RunSummary(
        label=label,
        final_step=int(scalars[TRAIN_LOSS].steps[-1]) if train is not None else None,
        final_loss=float(train[-1]) if train is not None else None,
        best_loss=_lowest(train) if train is not None else None,
        final_val_loss=float(val[-1]) if val is not None else None,
        best_val_loss=_lowest(val) if val is not None else None,
        gap=None,
        tokens_per_sec=float(np.mean(tokens)) if tokens is not None else None,
        inter_bytes_per_step=float(np.mean(inter)) if inter is not None else None,
        peak_memory_bytes=float(np.max(memory)) if memory is not None else None,
    )


def _with_own_end(row: RunSummary, run: Run) -> RunSummary:
    if not _has(run, TRAIN_LOSS):
        return row
    train = run.scalars[TRAIN_LOSS]
    return replace(row, own_last_step=int(train.steps[-1]), own_final_loss=float(train.values[-1]))


def _lowest(values: np.ndarray) -> float:
    """The best loss ignores NaN/inf points (a diverged step); NaN when every point is."""
    finite = values[np.isfinite(values)]
    return float(finite.min()) if len(finite) else math.nan


def _with_gaps(rows: list[RunSummary], notes: list[str]) -> list[RunSummary]:
    reference = rows[0].final_loss
    if reference is None:
        notes.append(f"gaps need the first run's {TRAIN_LOSS}, which {rows[0].label} lacks")
        return rows
    return [replace(row, gap=None if row.final_loss is None else row.final_loss - reference) for row in rows]
