"""The two-level quality sweep's table and plots: `python -m benchmarks.outer_sweep OUT --experiment NAME`.

`tools/run_outer_experiment.sh NAME` trains an experiment of `benchmarks.outer_plan` (a
synchronous reference and two-level runs), each under `OUT/seed<S>/<run>`. The experiment's
targets bound a run's mean final validation loss above the reference's on the same seeds, as a
fraction of the reference's. Every run reads the same global batches (an island takes its share
of each), so runs of one seed are at equal tokens.

Reported per run, as mean +- sample std [min, max] over the seeds that finished: the final
training loss (the last logged interval), the mean of the logged intervals over the last
`--train-window` steps (the less noisy estimate, see `benchmarks.loco_gap`), the final
validation loss and its gap to `sync`; and the inter-node bytes per step rank 0 counted
(`comm/inter_bytes` averaged over every step, outer syncs included; each rank of these layouts
counts the same share, so the world's is 4 times this). A run with fewer seeds than `sync`
says so rather than being compared on other seeds' means.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from benchmarks.outer_plan import EXPERIMENTS, Experiment
from megazpp.analysis.comparison import INTER_BYTES, TRAIN_LOSS, VAL_LOSS
from megazpp.analysis.event_reader import Run, read_run
from megazpp.analysis.plots import plot_seed_bands, save_png
from megazpp.errors import MegazppError
from megazpp.unique_keys import JSONObject

FINISHED = "DONE"


def describe(name: str, config: JSONObject | None) -> str:
    """The run as its logged config says it trained (the name where a run logged none)."""
    config = config or {}
    outer = config.get("outer")
    if not outer:
        return name
    if outer["algorithm"] == "none":
        return f"synchronous ZeRO-{config['zero']['stage']}" if "zero" in config else "synchronous"
    feedback = (
        ""
        if outer["quantize"] != "int4"
        else (" + error feedback" if outer["error_feedback"] else ", no error feedback")
    )
    warmup = f", warmup {outer['warmup_syncs']} syncs" if outer.get("warmup_syncs") else ""
    if outer.get("optimizer_state_every"):
        warmup += f", inner optimizer state averaged every {outer['optimizer_state_every']} sync(s)"
    elif outer.get("exp_avg_every") or outer.get("exp_avg_sq_every"):  # as logged before the one period
        warmup += f", moments averaged every {outer.get('exp_avg_every', 0)}/{outer.get('exp_avg_sq_every', 0)} syncs"
    lr = config.get("optimizer", {}).get("lr")
    return (
        f"H = {outer['sync_every']}, {outer['quantize']}{feedback}, outer lr {outer['lr']:g} "
        f"momentum {outer['momentum']:g}{warmup}{f', inner lr {lr:g}' if lr else ''}"
    )


@dataclass(frozen=True)
class SeedResult:
    seed: int
    final_train: float
    window_train: float
    final_val: float
    inter_bytes_per_step: float


def seed_result(run: Run, seed: int, window: int) -> SeedResult:
    for tag in (TRAIN_LOSS, VAL_LOSS, INTER_BYTES):
        if tag not in run.scalars or not len(run.scalars[tag]):
            raise MegazppError(f"{run.directory}: no '{tag}' scalars; expected a finished training run")
    train = run.scalars[TRAIN_LOSS]
    last = int(train.steps[-1])
    return SeedResult(
        seed,
        float(train.values[-1]),
        float(train.within(last - window + 1, last).values.mean()),
        float(run.scalars[VAL_LOSS].values[-1]),
        float(np.mean(run.scalars[INTER_BYTES].values)),
    )


def finished_runs(out: Path, experiment: Experiment) -> dict[str, dict[int, Path]]:
    """run name -> seed -> directory, for the runs that left `DONE`, in the plan's order."""
    found: dict[str, dict[int, Path]] = {}
    for marker in sorted(out.glob(f"seed*/*/{FINISHED}")):
        seed = re.fullmatch(r"seed(\d+)", marker.parent.parent.name)
        if seed:
            found.setdefault(marker.parent.name, {})[int(seed.group(1))] = marker.parent
    reference = experiment.reference
    if reference not in found:
        raise MegazppError(
            f"{out}: no finished '{reference}' run (seed*/{reference}/{FINISHED}); "
            f"expected tools/run_outer_experiment.sh {experiment.name}'s output directory"
        )
    rank = {name: i for i, name in enumerate(experiment.runs)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def report(out: Path, experiment: Experiment, window: int) -> tuple[list[str], dict[str, list[SeedResult]]]:
    """The table's lines and verdicts, and each run's results under its name and description."""
    runs = finished_runs(out, experiment)
    ref_name = experiment.reference
    read = {name: {s: read_run(d, f"{name}/s{s}") for s, d in seeds.items()} for name, seeds in runs.items()}
    results = {name: [seed_result(run, s, window) for s, run in seeds.items()] for name, seeds in read.items()}
    names = {name: describe(name, next(iter(seeds.values())).config) for name, seeds in read.items()}
    reference = {r.seed: r for r in results[ref_name]}
    lines = [
        f"| run | seeds | final train loss | train loss, last {window} steps | final val loss | "
        f"val gap to {ref_name} (same seeds) | inter-node MB per step, rank 0 |",
        "|---|---|---|---|---|---|---:|",
    ]
    verdicts = []
    for name, rows in results.items():
        paired = [r.final_val - reference[r.seed].final_val for r in rows if r.seed in reference]
        relative = [r.final_val / reference[r.seed].final_val - 1 for r in rows if r.seed in reference]
        gap = (
            "reference"
            if name == ref_name
            else (f"{statistics.mean(paired):+.4f} ({statistics.mean(relative):+.2%})" if paired else "n/a")
        )
        lines.append(
            f"| {names[name]} | {','.join(str(r.seed) for r in rows)} | "
            f"{_spread([r.final_train for r in rows])} | {_spread([r.window_train for r in rows])} | "
            f"{_spread([r.final_val for r in rows])} | {gap} | "
            f"{statistics.mean(r.inter_bytes_per_step for r in rows) / 1e6:.3f} |"
        )
        if name in experiment.targets and paired:
            mean_gap, target = statistics.mean(relative), experiment.targets[name]
            verdict = "meets" if mean_gap <= target else "misses"
            verdicts.append(
                f"{names[name]}: mean val gap {mean_gap:+.2%} over seeds "
                f"{','.join(str(r.seed) for r in rows if r.seed in reference)} ({verdict} the "
                f"<= {target:.1%} target{'' if len(paired) >= 3 else '; fewer than 3 seeds'})"
            )
    # keyed by the run's name too: two runs of the same settings (the defaults and the run that
    # spells them out) have one description
    labels = {name: name if names[name] == name else f"{name}: {names[name]}" for name in results}
    return lines + [""] + verdicts, {labels[name]: rows for name, rows in results.items()}


def plot_loss_against_bytes(results: dict[str, list[SeedResult]], path: Path) -> None:
    """Final validation loss (mean, min..max bars) against inter-node bytes per step."""
    figure = Figure(figsize=(12, 5), dpi=110)
    axes = figure.subplots()
    for name, rows in results.items():
        x = statistics.mean(r.inter_bytes_per_step for r in rows) / 1e6
        values = [r.final_val for r in rows]
        mean = statistics.mean(values)
        axes.errorbar(
            [x],
            [mean],
            yerr=[[mean - min(values)], [max(values) - mean]],
            fmt="o",
            capsize=4,
            label=f"{name} ({len(rows)} seed{'s' if len(rows) > 1 else ''})",
        )
    axes.set_xscale("log")
    axes.set(
        xlabel="inter-node MB per step (rank 0, counted)",
        ylabel="final validation loss",
        title="Two-level training: quality against inter-node traffic (equal tokens)",
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside: points stay visible
    figure.tight_layout()
    save_png(figure, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="tools/run_outer_experiment.sh's output directory (runs/outer/NAME)")
    p.add_argument("--experiment", required=True, choices=sorted(EXPERIMENTS), help="the plan the runs follow")
    p.add_argument(
        "--train-window",
        type=int,
        default=100,
        metavar="STEPS",
        help="steps of the windowed final training loss (default 100)",
    )
    p.add_argument("--out", help="also write the table to this Markdown file")
    p.add_argument("--plot", help="also draw loss against bytes to this PNG, and the curves beside it (_curves.png)")
    ns = p.parse_args(argv)
    if ns.train_window < 1:
        p.error(f"--train-window {ns.train_window}: expected a positive number of steps")
    try:
        experiment = EXPERIMENTS[ns.experiment]
        lines, results = report(Path(ns.directory), experiment, ns.train_window)
        if ns.plot:
            plot_loss_against_bytes(results, Path(ns.plot))
            runs = finished_runs(Path(ns.directory), experiment)
            curves = Path(ns.plot).with_name(Path(ns.plot).stem + "_curves.png")
            plot_seed_bands(
                {name: [read_run(d, name) for d in seeds.values()] for name, seeds in zip(results, runs.values())},
                curves,
            )
    except MegazppError as exc:
        print(f"outer_sweep: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if ns.out:
        tmp = f"{ns.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("# Two-level quality sweep\n\n" + "\n".join(lines) + "\n")
        os.replace(tmp, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
