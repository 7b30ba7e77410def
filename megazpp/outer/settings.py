"""The `outer` config section (two-level training) and the checked options it resolves to.

Why here and not in `megazpp.config`: the section belongs to the code that uses it (design
decision 11). The config layer only composes `OuterSettings` into its schema (so YAML keys
and `--outer-*` flags work like every other section's); `OuterSettings.resolve` turns the
values into one typed `OuterOptions`, refusing in one line anything unknown, out of range or
not implemented, before any rank starts. It imports nothing of megazpp but errors, so the
schema can import it; the runtime (`megazpp.outer.diloco`) takes `OuterOptions` only.
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
    `lr` and `momentum` on the islands' averaged pseudo-gradient, moved in `quantize` format."""

    sync_every: int
    lr: float
    momentum: float
    quantize: Literal["none", "bf16", "int4"]
    island_nodes: int
    fragments: int = 1  # streaming: fragments synced at staggered steps
    overlap_steps: int = 0  # tau: inner steps an exchange runs before it is applied
    merge_alpha: float = 0.5  # with tau > 0: weight of the island's own parameters when applied
    error_feedback: bool = True  # int4: what the wire dropped is added back at the next sync


@dataclass
class OuterSettings:
    """Islands of synchronous ZeRO joined by an outer optimizer (docs/arch/outer.md).

    `algorithm` none (the default) is plain synchronous data parallelism over all ranks;
    diloco runs the ZeRO engine inside each island of `island_nodes` nodes and every
    `sync_every` (H) inner steps averages the islands' pseudo-gradients (parameters at the last
    sync minus now) and applies Nesterov SGD (`lr`, `momentum`: DiLoCo's 0.7 and 0.9)."""

    algorithm: str = "none"
    sync_every: int = 20
    lr: float = 0.7
    momentum: float = 0.9
    fragments: int = 1
    overlap_steps: int = 0
    merge_alpha: float = 0.5
    quantize: str = "none"
    error_feedback: bool = True
    island_nodes: int = 1

    def resolve(self) -> OuterOptions | None:
        """The checked options, or None when two-level training is off; ConfigError naming the
        key for a value that is unknown, out of range, or asks for what is not built."""
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"outer.algorithm = {self.algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
        if self.algorithm == "none":
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
            return None
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
        default_alpha = next(f.default for f in fields(self) if f.name == "merge_alpha")
        if self.merge_alpha != default_alpha and not self.overlap_steps:
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
        return OuterOptions(
            self.sync_every,
            self.lr,
            self.momentum,
            self.quantize,  # type: ignore[arg-type]
            self.island_nodes,
            self.fragments,
            self.overlap_steps,
            self.merge_alpha,
            self.error_feedback,
        )
