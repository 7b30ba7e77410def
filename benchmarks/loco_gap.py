"""How much of int4's loss gap LoCo closes: `python -m benchmarks.loco_gap FP32 INT4 LOCO`.

The LoCo paper's claim, as the experiment tests it: with g = final loss, closed =
(g(int4) - g(int4 + LoCo)) / (g(int4) - g(fp32)); the target is closed >= 0.5. Computed for
the training loss (the interval mean at the last common step, what compare_runs reports) and
the validation loss (the same held-out batches every time, so the less noisy of the two).
When int4 is not worse than fp32 there is no gap to close, and the line says so instead of
dividing by a non-positive number. Optionally written to a Markdown file next to the plots.

Several seeds: each of FP32, INT4, LOCO may be a comma-separated list of run directories, one
per seed in the same order. At a high learning rate one seed mostly measures which run
happens to hit a gradient spike, so the verdict uses the mean over seeds; each run's mean and
spread (sample standard deviation, min..max) and each seed's own closed fraction are listed;
`--plot` draws each run's mean curves over its seeds with min..max bands.

`--train-window N` adds a second training-loss estimate beside the first (which stays the
verdict's first line): the mean of the logged interval means over the last N common steps. Why:
one logged interval (10 steps at the experiment's log_interval, 16 x 128 tokens a step)
scatters around its neighbours by 0.038-0.055 in the experiment, half of int4's gap, while the
runs of one seed read the same batches, so over the last 100 steps (lr near its minimum) their
losses trend alike and a mean of 10 intervals compares them with a tenth of that variance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from megazpp.analysis.comparison import TRAIN_LOSS, Comparison, compare_runs
from megazpp.analysis.event_reader import Run, read_run
from megazpp.analysis.plots import plot_seed_bands
from megazpp.errors import MegazppError

TARGET = 0.5


def closed_fraction(fp32: float, int4: float, loco: float) -> float | None:
    """Share of int4's gap to fp32 that LoCo removes; None when int4 has no gap."""
    gap = int4 - fp32
    if not gap > 0:
        return None
    return (int4 - loco) / gap


def describe(kind: str, fp32: float | None, int4: float | None, loco: float | None) -> str:
    if fp32 is None or int4 is None or loco is None:
        return f"{kind}: n/a (a run lacks this loss)"
    closed = closed_fraction(fp32, int4, loco)
    losses = f"fp32 {fp32:.4f}, int4 {int4:.4f}, int4+LoCo {loco:.4f}"
    if closed is None:
        return f"{kind}: {losses}; int4 is not worse than fp32, so there is no gap to close"
    verdict = "meets" if closed >= TARGET else "misses"
    return (
        f"{kind}: {losses}; int4 gap {int4 - fp32:+.4f}, LoCo gap {loco - fp32:+.4f}: "
        f"LoCo closes {100 * closed:.0f}% of the gap ({verdict} the >= {100 * TARGET:.0f}% target)"
    )


def _spread(measured: list[float | None]) -> str:
    values = [v for v in measured if v is not None]
    if len(values) != len(measured):
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def _mean(measured: list[float | None]) -> float | None:
    values = [v for v in measured if v is not None]
    return None if len(values) != len(measured) else statistics.mean(values)


NAMES = ("fp32", "int4", "int4+LoCo")


def _split(run_dirs: Sequence[str]) -> list[list[str]]:
    per_run = [d.split(",") for d in run_dirs]
    if len({len(dirs) for dirs in per_run}) != 1:
        raise MegazppError(
            f"loco_gap: the three runs list {[len(d) for d in per_run]} seed directories; "
            f"expected the same seeds for fp32, int4 and int4+LoCo"
        )
    return per_run


def _read(per_run: list[list[str]]) -> list[list[Run]]:
    return [[read_run(d, name) for d in dirs] for dirs, name in zip(per_run, NAMES)]


def plot(run_dirs: Sequence[str], path: str) -> None:
    """Mean training and validation loss of each run over its seeds, with min..max bands."""
    plot_seed_bands(dict(zip(NAMES, _read(_split(run_dirs)))), Path(path))


def window_mean(c: Comparison, run: int, window: int) -> float | None:
    """Mean of run `run`'s logged training losses over the last `window` common steps."""
    if c.step_range is None or TRAIN_LOSS not in c.runs[run].scalars:
        return None
    last = c.step_range[1]
    values = c.runs[run].scalars[TRAIN_LOSS].within(last - window + 1, last).values
    return float(values.mean()) if len(values) else None


def report(run_dirs: Sequence[str], train_window: int | None = None) -> list[str]:
    """`run_dirs`: FP32, INT4, LOCO, each one directory or a comma-separated list (one per seed);
    `train_window`: also estimate the final train loss over that many last steps."""
    per_run = _split(run_dirs)
    seeds = [compare_runs(runs) for runs in zip(*_read(per_run))]
    train = [[c.summaries[i].final_loss for c in seeds] for i in range(3)]
    val = [[c.summaries[i].final_val_loss for c in seeds] for i in range(3)]
    kinds = [("train", "final train loss", train), ("validation", "final validation loss", val)]
    if train_window is not None:
        windowed = [[window_mean(c, i, train_window) for c in seeds] for i in range(3)]
        kinds.append((f"last-{train_window}-steps train", f"train loss over the last {train_window} steps", windowed))
    n = len(seeds)
    over = "" if n == 1 else f" (mean of {n} seeds)"
    lines = [describe(f"{title}{over}", *map(_mean, losses)) for _, title, losses in kinds]
    if n > 1:
        for i, name in enumerate(("fp32", "int4", "int4+LoCo")):
            lines.append(f"{name}: " + ", ".join(f"{title} {_spread(losses[i])}" for _, title, losses in kinds))
        for kind, _, losses in kinds:
            closed = [None if None in seed else closed_fraction(*seed) for seed in zip(*losses)]
            shown = ", ".join("n/a" if c is None else f"{100 * c:.0f}%" for c in closed)
            lines.append(f"per seed, LoCo closes of the {kind} gap: {shown}")
    ranges = {c.step_range for c in seeds if c.step_range}
    if len(ranges) == 1:
        lo, hi = ranges.pop()
        lines.append(f"(over the common steps {lo}..{hi})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for run in ("fp32", "int4", "loco"):
        p.add_argument(run, help="run directory, or comma-separated directories (one per seed)")
    p.add_argument("--out", help="also write these lines to this Markdown file")
    p.add_argument("--plot", help="also draw each run's mean loss over seeds, with bands, to this PNG")
    p.add_argument(
        "--train-window",
        type=int,
        metavar="STEPS",
        help="also estimate the final train loss as the mean over the last STEPS steps",
    )
    ns = p.parse_args(argv)
    if ns.train_window is not None and ns.train_window < 1:
        p.error(f"--train-window {ns.train_window}: expected a positive number of steps")
    try:
        lines = report([ns.fp32, ns.int4, ns.loco], ns.train_window)
        if ns.plot:
            plot([ns.fp32, ns.int4, ns.loco], ns.plot)
    except MegazppError as exc:
        print(f"loco_gap: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if ns.out:
        tmp = f"{ns.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("# LoCo experiment: gap closed\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
        os.replace(tmp, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
