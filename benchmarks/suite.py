"""The configurations the network benchmark compares, as data: a name, a runner, its flags.

Why one list: `--only` selects from it, the result table keeps its order, and the tests check
it, so a configuration cannot be benchmarked under one name and reported under another.
Every megazpp configuration runs `pretrain_gpt.py` with flags on top of the benchmark YAML;
every DeepSpeed one runs `benchmarks/deepspeed_peer.py` with a `zero_optimization` override;
the torchft one runs `benchmarks/torchft_peer.py` (one launcher per node: a replica group).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from megazpp.errors import ConfigError
from megazpp.unique_keys import JSONObject
from megazpp.zero.strategy import VALID_NAMES

MEGAZPP, DEEPSPEED, TORCHFT = "megazpp", "deepspeed", "torchft"
PRETRAIN_SCRIPT = "pretrain_gpt.py"
PEER_SCRIPT = "benchmarks/deepspeed_peer.py"
TORCHFT_SCRIPT = "benchmarks/torchft_peer.py"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    runner: str  # MEGAZPP, DEEPSPEED or TORCHFT
    flags: tuple[str, ...] = ()
    ds_zero: JSONObject = field(default_factory=dict)

    @property
    def sync_every(self) -> int | None:
        """H of a two-level row (`--outer-sync-every`), None for a synchronous one."""
        if "--outer-sync-every" not in self.flags:
            return None
        return int(self.flags[self.flags.index("--outer-sync-every") + 1])

    @property
    def script(self) -> str:
        return {MEGAZPP: PRETRAIN_SCRIPT, DEEPSPEED: PEER_SCRIPT, TORCHFT: TORCHFT_SCRIPT}[self.runner]

    def script_args(self) -> list[str]:
        """Arguments after the script (the shared YAML and data flags are added by the caller)."""
        if self.runner != DEEPSPEED:
            return list(self.flags)
        return ["--ds-zero", json.dumps(self.ds_zero, sort_keys=True), *self.flags]


def all_configs(ranks_per_node: int) -> list[BenchConfig]:
    """Every configuration, in table order. hpZ's secondary group is one node's DP ranks."""
    hpz = str(ranks_per_node)
    zero3 = ("--zero-stage", "3")
    qwz, hpz_flags, qgz = (
        ("--zero-quantized-weights",),
        ("--zero-hpz-partition-size", hpz),
        ("--zero-quantized-gradients",),
    )
    configs = [
        BenchConfig("zero3", MEGAZPP, zero3),
        BenchConfig("zero3+qwz", MEGAZPP, zero3 + qwz),
        BenchConfig("zero3+hpz", MEGAZPP, zero3 + hpz_flags),
        BenchConfig("zero3+qgz", MEGAZPP, zero3 + qgz),
        BenchConfig("zeropp", MEGAZPP, zero3 + qwz + hpz_flags + qgz),
        BenchConfig("zeropp+loco", MEGAZPP, zero3 + qwz + hpz_flags + qgz + ("--loco",)),
    ]
    configs += [BenchConfig(f"paro-{name}", MEGAZPP, ("--paro-strategy", name)) for name in VALID_NAMES]
    configs += two_level_configs()
    configs += [
        BenchConfig("ds-zero3", DEEPSPEED),
        BenchConfig("ds-zero3+hpz", DEEPSPEED, ds_zero={"zero_hpz_partition_size": ranks_per_node}),
        # DeepSpeed's quantized paths call CUDA kernels; they are attempted so the table
        # records DeepSpeed's own refusal on a CPU run rather than an assumption.
        BenchConfig("ds-zero3+qwz", DEEPSPEED, ds_zero={"zero_quantized_weights": True}),
        BenchConfig("ds-zero3+qgz", DEEPSPEED, ds_zero={"zero_quantized_gradients": True}),
    ]
    configs += [torchft_config()]
    return configs


TWO_LEVEL_SYNC_EVERY = 20


# DiLoCo's published outer step, each island keeping its inner optimizer's state, on the
# two-level rows and torchft's alike (so the peer runs the same optimisation, and the rows stay
# what docs/benchmarks.md measured before the outer section's defaults became plain averaging
# with that state averaged)
DILOCO_OUTER_STEP = ("--outer-lr", "0.7", "--outer-momentum", "0.9", "--outer-optimizer-state-every", "0")


def two_level_configs() -> list[BenchConfig]:
    """Issue 28's two-level rows: ZeRO-3 inside each island (one node: its 2 ranks), DiLoCo
    across islands every 20 inner steps, with bf16 outer gradients, int4, and bf16 streamed in 4
    fragments each overlapped by one inner step, DiLoCo's outer lr 0.7 / Nesterov 0.9. The flags
    are the `outer` section's (megazpp/outer/settings.py, docs/flags.md); these rows change the optimisation, so their
    losses are not the synchronous rows'."""
    base: tuple[str, ...] = (
        "--zero-stage",
        "3",
        "--outer-algorithm",
        "diloco",
        "--outer-sync-every",
        str(TWO_LEVEL_SYNC_EVERY),
    )
    base += DILOCO_OUTER_STEP
    return [
        BenchConfig("diloco-h20-bf16", MEGAZPP, base + ("--outer-quantize", "bf16")),
        BenchConfig("diloco-h20-int4", MEGAZPP, base + ("--outer-quantize", "int4")),
        BenchConfig(
            "diloco-h20-bf16-stream",
            MEGAZPP,
            base + ("--outer-quantize", "bf16", "--outer-fragments", "4", "--outer-overlap-steps", "1"),
        ),
    ]


def torchft_config() -> BenchConfig:
    """torchft's DiLoCo beside the two-level rows: one replica group per node (FSDP2 inside),
    H = 20, DiLoCo's outer lr 0.7 and momentum 0.9, fp32 outer gradients (torchft's only wire
    format on CPU)."""
    return BenchConfig(
        "torchft-diloco-h20",
        TORCHFT,
        ("--outer-algorithm", "diloco", "--outer-sync-every", str(TWO_LEVEL_SYNC_EVERY)) + DILOCO_OUTER_STEP,
    )


def steps_fit(c: BenchConfig, steps: int, warmup: int) -> bool:
    """Whether a run of `steps` (`warmup` of them left out of the step time) measures whole
    outer intervals of `c` (always, for a synchronous row)."""
    h = c.sync_every
    return h is None or (steps % h == 0 and (steps - warmup) % h == 0)


def check_steps(configs: Sequence[BenchConfig], steps: int, warmup: int) -> None:
    """Two-level rows move their outer bytes once per H steps: a run whose measured steps (after
    `warmup`) are not whole intervals would report per-step bytes and times without their share
    of the syncs, so it is refused."""
    for c in configs:
        h = c.sync_every
        if h is not None and not steps_fit(c, steps, warmup):  # a synchronous row always fits
            raise ConfigError(
                f"--steps {steps} --warmup {warmup}: {c.name} syncs every {h} inner steps; give "
                f"--steps and --steps minus --warmup as multiples of {h} (e.g. --steps {2 * h} "
                f"--warmup {h}) so the per-step numbers include its outer syncs, or leave it out "
                f"with --only"
            )


def select(configs: Sequence[BenchConfig], names: Sequence[str] | None) -> list[BenchConfig]:
    """The configurations named (in table order), all of them for None; unknown names refused."""
    if not names:
        return list(configs)
    known = {c.name for c in configs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"--only: unknown configuration(s) {', '.join(unknown)}; expected names "
            f"from: {', '.join(c.name for c in configs)}"
        )
    wanted = set(names)
    return [c for c in configs if c.name in wanted]
