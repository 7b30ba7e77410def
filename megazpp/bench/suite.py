"""The configurations the network benchmark compares, as data: a name, a runner, its flags.

Why one list: `--only` selects from it, the result table keeps its order, and the tests check
it, so a configuration cannot be benchmarked under one name and reported under another.
Every megazpp configuration runs `pretrain_gpt.py` with flags on top of the benchmark YAML;
every DeepSpeed one runs `megazpp/bench/deepspeed_peer.py` with a `zero_optimization` override.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from megazpp.errors import ConfigError
from megazpp.zero.strategy import VALID_NAMES

MEGAZPP, DEEPSPEED = "megazpp", "deepspeed"
PRETRAIN_SCRIPT = "pretrain_gpt.py"
PEER_SCRIPT = "megazpp/bench/deepspeed_peer.py"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    runner: str  # MEGAZPP or DEEPSPEED
    flags: tuple[str, ...] = ()
    ds_zero: dict[str, Any] = field(default_factory=dict)

    @property
    def script(self) -> str:
        return PRETRAIN_SCRIPT if self.runner == MEGAZPP else PEER_SCRIPT

    def script_args(self) -> list[str]:
        """Arguments after the script (the shared YAML and data flags are added by the caller)."""
        if self.runner == MEGAZPP:
            return list(self.flags)
        return ["--ds-zero", json.dumps(self.ds_zero, sort_keys=True), *self.flags]


def all_configs(ranks_per_node: int) -> list[BenchConfig]:
    """Every configuration, in table order. hpZ's secondary group is one node's DP ranks."""
    hpz = str(ranks_per_node)
    zero3 = ("--zero-stage", "3")
    qwz, hpz_flags, qgz = ("--zero-quantized-weights",), ("--zero-hpz-partition-size", hpz), ("--zero-quantized-gradients",)
    configs = [
        BenchConfig("zero3", MEGAZPP, zero3),
        BenchConfig("zero3+qwz", MEGAZPP, zero3 + qwz),
        BenchConfig("zero3+hpz", MEGAZPP, zero3 + hpz_flags),
        BenchConfig("zero3+qgz", MEGAZPP, zero3 + qgz),
        BenchConfig("zeropp", MEGAZPP, zero3 + qwz + hpz_flags + qgz),
        BenchConfig("zeropp+loco", MEGAZPP, zero3 + qwz + hpz_flags + qgz + ("--loco",)),
    ]
    configs += [BenchConfig(f"paro-{name}", MEGAZPP, ("--paro-strategy", name)) for name in VALID_NAMES]
    configs += [
        BenchConfig("ds-zero3", DEEPSPEED),
        BenchConfig("ds-zero3+hpz", DEEPSPEED, ds_zero={"zero_hpz_partition_size": ranks_per_node}),
        # DeepSpeed's quantized paths call CUDA kernels; they are attempted so the table
        # records DeepSpeed's own refusal on a CPU run rather than an assumption.
        BenchConfig("ds-zero3+qwz", DEEPSPEED, ds_zero={"zero_quantized_weights": True}),
        BenchConfig("ds-zero3+qgz", DEEPSPEED, ds_zero={"zero_quantized_gradients": True}),
    ]
    return configs


def select(configs: Sequence[BenchConfig], names: Sequence[str] | None) -> list[BenchConfig]:
    """The configurations named (in table order), all of them for None; unknown names refused."""
    if not names:
        return list(configs)
    known = {c.name for c in configs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--only: unknown configuration(s) {', '.join(unknown)}; expected names "
                          f"from: {', '.join(c.name for c in configs)}")
    wanted = set(names)
    return [c for c in configs if c.name in wanted]
