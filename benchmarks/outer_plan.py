"""The two-level quality experiments as data: which runs, with which flags, in which order.

`tools/run_outer_experiment.sh NAME` trains an experiment's queue through `run.sh` (resumable:
a finished run is never redone) and `benchmarks.outer_sweep` reports it; both read this file,
so a run's name means the same flags everywhere. Why data and not a script per experiment: the
experiments share the model and data and differ in schedule, runs and targets, and the tuning
stage decides the flags of the main one (an edit here, with the measurement that chose it).

Every run of an experiment reads the same global batches (an island takes its share of each),
so runs of one seed are at equal tokens. Seed 4 is the tuning seed: no reported run uses it.
Run names say their settings: hN (H = N), int4 / noef (the wire, without error feedback), lrN
(inner lr N e-3), olrNN / omNN (outer lr / momentum N.N), warmN (outer warmup over N syncs),
stateK (the inner optimizer's state averaged across islands every K syncs, else kept per
island), plain (outer lr 1, momentum 0), defaults (no outer optimizer flag: the code's defaults,
the state's period included), otherwise DiLoCo's outer lr 0.7 / Nesterov 0.9, sync (no
islands); tests/test_bench_outer_sweep.py holds every name to its flags. Runs measured with
settings the code no longer has are out of the plan, their numbers kept in docs/benchmarks.md
with the commit that made them (defaults600's DES-LOC periods, first moment every 3 syncs and
second every 6, before the two periods became `outer.optimizer_state_every`).

    python -m benchmarks.outer_plan queue NAME   # "seed run flags..." per line, in priority order
    python -m benchmarks.outer_plan list         # the experiments
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

LOCO = "configs/experiments/loco/fp32.yaml"
REFERENCE = "sync"
TUNING_SEED = 4
# the inner optimizer's state kept per island: what every two-level run measured before the
# defaults averaged it (defaults600), so that such runs keep their meaning
LOCAL_STATE = ("--outer-optimizer-state-every", "0")
DILOCO = ("--outer-algorithm", "diloco", *LOCAL_STATE)
PLAIN = ("--outer-lr", "1.0", "--outer-momentum", "0")  # plain averaging (the defaults since defaults600)
NESTEROV = ("--outer-lr", "0.7", "--outer-momentum", "0.9")  # DiLoCo's published setting


@dataclass(frozen=True)
class Experiment:
    """One experiment: `config` plus `common` flags on every run, each run's own flags on top
    (later flags win), the queue of (seed, run) in priority order, and the targets: run ->
    the most its mean final validation loss may exceed the reference's on the same seeds, as a
    fraction of the reference's (0.01: within 1%)."""

    name: str
    about: str
    common: tuple[str, ...]
    runs: dict[str, tuple[str, ...]]
    queue: tuple[tuple[int, str], ...]
    targets: dict[str, float] = field(default_factory=dict)
    config: str = LOCO
    reference: str = REFERENCE  # the synchronous run the gaps are measured to

    def flags(self, run: str) -> list[str]:
        return [*self.common, *self.runs[run]]


def _queue(seeds: Sequence[int], runs: Sequence[str]) -> tuple[tuple[int, str], ...]:
    return tuple((s, r) for s in seeds for r in runs)


# Issue 28's sweep (docs/benchmarks.md, "Two-level training: quality at equal tokens"): 600
# steps from scratch, plain averaging, bf16 outer gradients; kept so its table can be remade.
_LOCO600_BF16 = (*DILOCO, "--outer-quantize", "bf16", *PLAIN)
LOCO600 = Experiment(
    "loco600",
    "issue 28: 600 steps from scratch, H 1-50, plain averaging",
    (),
    {
        REFERENCE: (),
        "h1": (*_LOCO600_BF16, "--outer-sync-every", "1"),
        "h5": (*_LOCO600_BF16, "--outer-sync-every", "5"),
        "h10": (*_LOCO600_BF16, "--outer-sync-every", "10"),
        "h25": (*_LOCO600_BF16, "--outer-sync-every", "25"),
        "h50": (*_LOCO600_BF16, "--outer-sync-every", "50"),
        "h25_int4": (*_LOCO600_BF16, "--outer-sync-every", "25", "--outer-quantize", "int4"),
        "h25_int4_noef": (
            *_LOCO600_BF16,
            "--outer-sync-every",
            "25",
            "--outer-quantize",
            "int4",
            "--no-outer-error-feedback",
        ),
        "h1_diloco": (*_LOCO600_BF16, "--outer-sync-every", "1", "--outer-lr", "0.7", "--outer-momentum", "0.9"),
        "h10_diloco": (*_LOCO600_BF16, "--outer-sync-every", "10", "--outer-lr", "0.7", "--outer-momentum", "0.9"),
        "h25_diloco": (*_LOCO600_BF16, "--outer-sync-every", "25", "--outer-lr", "0.7", "--outer-momentum", "0.9"),
    },
    _queue((1, 2, 3), (REFERENCE, "h10", "h25"))
    + _queue((1, 2, 3), ("h25_int4", "h25_int4_noef"))
    + _queue((1, 2, 3), ("h1", "h5", "h50"))
    + _queue((1,), ("h1_diloco", "h10_diloco", "h25_diloco")),
)

_STATE1 = ("--outer-optimizer-state-every", "1")

# Issue 37: the outer defaults a user's first try gets (`--outer-algorithm diloco` and nothing
# else: H 20, no wire compression), from scratch on the 600-step schedule. Candidates on the
# tuning seed; then plain averaging (then the defaults) and the best candidate (the inner
# optimizer's state averaged at every sync) on seeds 1-3, which made that the defaults too;
# the defaults again on every seed.
DEFAULTS600 = Experiment(
    "defaults600",
    "issue 37: outer optimizer settings at the default H, 600 steps from scratch",
    (),
    {
        REFERENCE: (),
        "defaults": ("--outer-algorithm", "diloco"),
        "nesterov": (*DILOCO, *NESTEROV),  # the defaults before this experiment
        "plain": (*DILOCO, *PLAIN),
        "warm5": (*DILOCO, *NESTEROV, "--outer-warmup-syncs", "5"),
        "warm10": (*DILOCO, *NESTEROV, "--outer-warmup-syncs", "10"),
        "olr05": (*DILOCO, *NESTEROV, "--outer-lr", "0.5"),
        "olr05_warm10": (*DILOCO, *NESTEROV, "--outer-lr", "0.5", "--outer-warmup-syncs", "10"),
        "olr10_om05": (*DILOCO, "--outer-lr", "1.0", "--outer-momentum", "0.5"),
        # Nesterov 0.9 moves lr (1 + 0.9 / 0.1) = 10 lr times the mean pseudo-gradient once its
        # buffer is full: lr 0.1-0.3 keeps that near plain averaging's 1 while smoothing over syncs
        "olr02_warm10": (*DILOCO, *NESTEROV, "--outer-lr", "0.2", "--outer-warmup-syncs", "10"),
        "olr03_warm10": (*DILOCO, *NESTEROV, "--outer-lr", "0.3", "--outer-warmup-syncs", "10"),
        # AdamW's moments averaged across islands at every sync
        "plain_state1": (*DILOCO, *PLAIN, *_STATE1),
    },
    _queue((TUNING_SEED,), (REFERENCE, "nesterov", "plain", "warm10", "olr05_warm10", "warm5", "olr05", "olr10_om05"))
    + _queue((TUNING_SEED,), ("plain_state1", "olr02_warm10", "olr03_warm10"))
    + _queue((1, 2, 3), (REFERENCE, "plain", "plain_state1"))
    + _queue((TUNING_SEED, 1, 2, 3), ("defaults",)),
)

# Issue 37's experiment in the method's regime: 3000 steps (the synchronous loss flattens; H 10
# gets 300 outer steps), evaluated on 8 batches. Tuning (seed 4): the inner lr of the
# synchronous baseline (2, 4, 8 e-3) and of the islands at H 40 with the code's defaults (4 and
# 6 e-3: Scaling Laws for DiLoCo finds the best inner lr about 1.2x data parallel's at 2
# replicas), and plain averaging with the state kept per island (its bytes a third).
_LONG = ("--train-iters", "3000", "--lr-warmup-iters", "150", "--eval-interval", "250", "--eval-iters", "8")
_H40 = ("--outer-sync-every", "40", "--outer-quantize", "bf16")
_LR6 = ("--lr", "6e-3", "--min-lr", "6e-4")
TUNE3000 = Experiment(
    "tune3000",
    "issue 37: inner lr of the synchronous baseline and of the islands (H 40), 3000 steps",
    _LONG,
    {
        "sync_lr2": ("--lr", "2e-3", "--min-lr", "2e-4"),
        "sync_lr4": (),
        "sync_lr8": ("--lr", "8e-3", "--min-lr", "8e-4"),
        "h40_defaults_lr4": ("--outer-algorithm", "diloco", *_H40),
        "h40_defaults_lr6": ("--outer-algorithm", "diloco", *_H40, *_LR6),
        "h40_plain_lr4": (*DILOCO, *_H40, *PLAIN),
    },
    _queue(
        (TUNING_SEED,), ("sync_lr4", "h40_defaults_lr4", "h40_plain_lr4", "sync_lr8", "h40_defaults_lr6", "sync_lr2")
    ),
    reference="sync_lr4",
)

EXPERIMENTS = {e.name: e for e in (LOCO600, DEFAULTS600, TUNE3000)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the experiments, a line each")
    sub.add_parser("names", help="the experiments' names")
    q = sub.add_parser("queue", help="an experiment's config, then its runs in priority order")
    q.add_argument("name", choices=sorted(EXPERIMENTS))
    ns = p.parse_args(argv)
    if ns.command == "names":
        print(" ".join(EXPERIMENTS))
        return 0
    if ns.command == "list":
        for e in EXPERIMENTS.values():
            print(f"{e.name}: {e.about} ({len(e.queue)} runs)")
        return 0
    e = EXPERIMENTS[ns.name]
    print(e.config)
    for seed, run in e.queue:
        print(seed, run, *e.flags(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
