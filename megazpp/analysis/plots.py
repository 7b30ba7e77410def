"""The two comparison figures, drawn with matplotlib's Agg canvas.

Why a Figure on an Agg canvas rather than pyplot: no global figure state and no display is
needed, so it works on headless nodes and inside tests. Each run keeps one colour across
both figures. Raw curves are drawn thin and faint under the smoothed ones, as in TensorBoard,
so noise is visible without hiding the trend. Files are written under a temporary name and
renamed, so an interrupted call never leaves a half-written PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megazpp.analysis.comparison import INTER_BYTES, THROUGHPUT_CAVEAT, TOKENS_PER_SEC, TRAIN_LOSS, VAL_LOSS, Comparison
from megazpp.analysis.event_reader import Run
from megazpp.analysis.smoothing import ema_debiased

MIB = 2.0**20


def plot_loss(comparison: Comparison, path: Path, smoothing: float) -> None:
    """Training loss per run (raw + smoothed), validation points, and the common range."""
    figure = Figure(figsize=(9, 5.5), dpi=110)
    axes = figure.add_subplot()
    for color, run in zip(_colors(len(comparison.runs)), comparison.runs):
        train = run.scalars.get(TRAIN_LOSS)
        if train is not None and len(train):
            axes.plot(
                train.steps,
                train.values,
                color=color,
                linewidth=1.0,
                alpha=0.45,
                marker="." if len(train) <= 50 else None,
                label=f"{run.label} train (raw)",
            )
            if smoothing > 0:
                axes.plot(
                    train.steps,
                    ema_debiased(train.values, smoothing),
                    color=color,
                    linewidth=1.8,
                    label=f"{run.label} train (smoothing {smoothing:.2g})",
                )
        val = run.scalars.get(VAL_LOSS)
        if val is not None and len(val):
            axes.plot(
                val.steps,
                val.values,
                linestyle="none",
                marker="o",
                markersize=6,
                markerfacecolor="white",
                markeredgecolor=color,
                markeredgewidth=1.5,
                label=f"{run.label} val",
            )
    if comparison.step_range and _lengths_differ(comparison):
        axes.axvline(
            comparison.step_range[1],
            color="grey",
            linestyle="--",
            linewidth=1,
            label=f"end of common steps ({comparison.step_range[1]})",
        )
    axes.set(xlabel="step", ylabel="loss", title="Training loss")
    _annotate_missing(axes, _missing(comparison, TRAIN_LOSS), TRAIN_LOSS)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    save_png(figure, path)


def plot_seed_bands(groups: dict[str, list[Run]], path: Path, smoothing: float = 0.6) -> None:
    """Per group (one configuration trained with several seeds): the mean over seeds of the
    smoothed training loss (left) and of the validation loss (right), each with a band from
    the lowest to the highest seed. Only steps every seed of a group logged are drawn."""
    figure = Figure(figsize=(11, 5), dpi=110)
    left, right = figure.subplots(1, 2)
    for color, (label, runs) in zip(_colors(len(groups)), groups.items()):
        for axes, tag, smooth in ((left, TRAIN_LOSS, smoothing), (right, VAL_LOSS, 0.0)):
            series = [s for s in (r.scalars.get(tag) for r in runs) if s is not None and len(s)]
            if len(series) != len(runs):  # a run without this tag
                continue
            steps = sorted(set.intersection(*(set(np.asarray(s.steps).tolist()) for s in series)))
            curves = np.stack(
                [
                    ema_debiased(np.asarray(s.values)[np.isin(s.steps, steps)], smooth)
                    if smooth
                    else np.asarray(s.values)[np.isin(s.steps, steps)]
                    for s in series
                ]
            )
            axes.plot(
                steps,
                curves.mean(axis=0),
                color=color,
                linewidth=1.8,
                marker="o" if tag == VAL_LOSS else None,
                label=f"{label} (mean of {len(runs)})",
            )
            axes.fill_between(steps, curves.min(axis=0), curves.max(axis=0), color=color, alpha=0.2)
    left.set(xlabel="step", ylabel="loss", title=f"Training loss (smoothing {smoothing:g}), min..max over seeds")
    right.set(xlabel="step", ylabel="loss", title="Validation loss, min..max over seeds")
    for axes in (left, right):
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    save_png(figure, path)


def plot_throughput(comparison: Comparison, path: Path) -> None:
    """Tokens/s (top) and inter-node bytes received per step (bottom), per run."""
    figure = Figure(figsize=(9, 7), dpi=110)
    top, bottom = figure.subplots(2, 1, sharex=True)
    colors = _colors(len(comparison.runs))
    for axes, tag, scale, ylabel in (
        (top, TOKENS_PER_SEC, 1.0, "tokens/s"),
        (bottom, INTER_BYTES, MIB, "inter-node MiB / step"),
    ):
        for color, run in zip(colors, comparison.runs):
            series = run.scalars.get(tag)
            if series is not None and len(series):
                axes.plot(series.steps, series.values / scale, color=color, marker=".", linewidth=1.2, label=run.label)
        axes.set(
            ylabel=ylabel,
            title=f"{tag} (depends on the machine's load during each run)" if tag == TOKENS_PER_SEC else tag,
        )
        axes.set_ylim(bottom=0)  # from zero, so the height ratio between runs is their speed ratio
        _annotate_missing(axes, _missing(comparison, tag), tag)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
        axes.grid(alpha=0.3)
    bottom.set_xlabel("step")
    figure.tight_layout()
    save_png(figure, path, description=THROUGHPUT_CAVEAT)


def _colors(count: int) -> list[str]:
    cycle = [f"C{i}" for i in range(10)]
    return [cycle[i % len(cycle)] for i in range(count)]


def _lengths_differ(comparison: Comparison) -> bool:
    lasts = {
        int(run.scalars[TRAIN_LOSS].steps[-1])
        for run in comparison.runs
        if TRAIN_LOSS in run.scalars and len(run.scalars[TRAIN_LOSS])
    }
    return len(lasts) > 1


def _missing(comparison: Comparison, tag: str) -> list[str]:
    return [run.label for run in comparison.runs if tag not in run.scalars or not len(run.scalars[tag])]


def _annotate_missing(axes: Axes, labels: list[str], tag: str) -> None:
    if labels:
        axes.text(
            0.01,
            0.02,
            f"no {tag} logged by: {', '.join(labels)}",
            transform=axes.transAxes,
            fontsize="small",
            color="dimgrey",
        )


def save_png(figure: Figure, path: Path, description: str | None = None) -> None:
    """Render `figure` to `path` atomically (temporary name, then rename); `description` goes
    into the PNG's Description text chunk, where image viewers show a caption."""
    FigureCanvasAgg(figure)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        figure.savefig(tmp, format="png", metadata={"Description": description} if description else None)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
