"""The `outer` config section (two-level training) and the checked options it maps onto.

Why here and not in `megazpp.config`: the section belongs to the code that uses it, as every
subsystem's options do. `OuterOptions` checks every rule of its own values when built, naming the key,
as `ZeroOptions` and `OptimizerOptions` do; the config layer above composes `OuterSettings`
into its schema (so YAML keys and `--outer-*` flags work like every other section's) and maps
it onto `OuterOptions` by field name (`megazpp.config.options.options_of`) when `enabled` says
two-level training is on, with the rules that span sections (islands against the world), before
any rank starts. It imports nothing of megazpp but errors; the runtime (`megazpp.outer.diloco`)
takes `OuterOptions` only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from megazpp.errors import ConfigError

ALGORITHMS = ("none", "diloco")
QUANTIZE = ("none", "bf16", "int4")  # outer-gradient wire formats (megazpp.outer.traffic)


@dataclass(frozen=True)
class OuterOptions:
    """Two-level training as resolved: DiLoCo every `sync_every` inner steps, Nesterov SGD with
    `lr` and `momentum` on the islands' averaged pseudo-gradient, moved in `quantize` format;
    ConfigError naming the `outer` key for a value out of range or asking for what is not built."""

    sync_every: int = 20
    lr: float = 0.7
    momentum: float = 0.9
    quantize: Literal["none", "bf16", "int4"] = "none"
    island_nodes: int = 1
    fragments: int = 1  # streaming: fragments synced at staggered steps
    overlap_steps: int = 0  # tau: inner steps an exchange runs before it is applied
    merge_alpha: float = 0.5  # with tau > 0: weight of the island's own parameters when applied
    error_feedback: bool = True  # int4: what the wire dropped is added back at the next sync

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"outer.sync_every = {self.sync_every}: expected at least 1 inner step per outer step")
        if not self.lr > 0:
            raise ConfigError(f"outer.lr = {self.lr}: expected a value > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum = {self.momentum}: expected a value in [0, 1)")
        if self.quantize not in QUANTIZE:
            raise ConfigError(f"outer.quantize = {self.quantize!r}: expected one of {', '.join(QUANTIZE)}")
        if self.island_nodes < 1:
            raise ConfigError(f"outer.island_nodes = {self.island_nodes}: expected a positive number of nodes")
        if self.fragments < 1:
            raise ConfigError(f"outer.fragments = {self.fragments}: expected at least 1")
        if self.overlap_steps < 0:
            raise ConfigError(f"outer.overlap_steps = {self.overlap_steps}: expected a value >= 0")
        if not 0 <= self.merge_alpha <= 1:
            raise ConfigError(f"outer.merge_alpha = {self.merge_alpha}: expected a value in [0, 1]")
        if self.fragments > self.sync_every:
            raise ConfigError(
                f"outer.fragments = {self.fragments} > outer.sync_every = {self.sync_every}: each "
                f"fragment syncs once per interval at its own step, so at most H fragments"
            )
        if self.overlap_steps >= self.sync_every:
            raise ConfigError(
                f"outer.overlap_steps = {self.overlap_steps}: a fragment's exchange must land before "
                f"its next one starts, so at most outer.sync_every - 1 = {self.sync_every - 1}"
            )
        if self.merge_alpha != OuterOptions.merge_alpha and not self.overlap_steps:
            raise ConfigError(
                f"outer.merge_alpha = {self.merge_alpha} mixes an overlapped exchange into the "
                f"island's parameters, and outer.overlap_steps is 0 (nothing overlaps): set "
                f"outer.overlap_steps or drop outer.merge_alpha"
            )
        if not self.error_feedback and self.quantize != "int4":
            raise ConfigError(
                f"outer.error_feedback = false: only the int4 wire drops anything to feed back, and "
                f"outer.quantize is {self.quantize!r}: set outer.quantize int4 or drop the setting"
            )


@dataclass
class OuterSettings:
    """Islands of synchronous ZeRO joined by an outer optimizer (docs/arch/outer.md).

    `algorithm` none (the default) is plain synchronous data parallelism over all ranks;
    diloco runs the ZeRO engine inside each island of `island_nodes` nodes and every
    `sync_every` (H) inner steps averages the islands' pseudo-gradients (parameters at the last
    sync minus now) and applies Nesterov SGD (`lr`, `momentum`: DiLoCo's 0.7 and 0.9). The
    other keys are `OuterOptions`' fields, with its defaults."""

    algorithm: str = "none"
    sync_every: int = OuterOptions.sync_every
    lr: float = OuterOptions.lr
    momentum: float = OuterOptions.momentum
    fragments: int = OuterOptions.fragments
    overlap_steps: int = OuterOptions.overlap_steps
    merge_alpha: float = OuterOptions.merge_alpha
    quantize: str = OuterOptions.quantize
    error_feedback: bool = OuterOptions.error_feedback
    island_nodes: int = OuterOptions.island_nodes

    def enabled(self) -> bool:
        """Whether two-level training is on; ConfigError for an unknown algorithm, or for a
        setting given while it is off (nothing would use it)."""
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"outer.algorithm = {self.algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
        if self.algorithm != "none":
            return True
        changed = [
            f"outer.{f.name} = {getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name != "algorithm" and getattr(self, f.name) != f.default
        ]
        if changed:
            raise ConfigError(
                f"{changed[0]} is set but outer.algorithm is none, so nothing would use it: "
                f"set outer.algorithm diloco (--outer-algorithm diloco) or drop the setting"
            )
        return False
