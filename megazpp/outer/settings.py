"""The `outer` config section (two-level training): `OuterOptions`, checked when built.

Why here and not in `megazpp.config`: the section belongs to the code that uses it, as `zero`'s
does to zero. `OuterOptions` checks every rule of its own values when built, naming the key, as
`ZeroOptions` and `OptimizerOptions` do; the config layer above reads YAML keys and `--outer-*`
flags onto its fields by name, and its check adds the rules that span sections (islands against
the world) before any rank starts, handing the runtime these options only when `enabled`. It
imports nothing of megazpp but errors and the field helper.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megazpp.errors import ConfigError
from megazpp.setting import setting

ALGORITHMS = ("none", "diloco")
QUANTIZE = ("none", "bf16", "int4")  # outer-gradient wire formats (megazpp.outer.traffic)
# The largest outer learning rate: lr 1 with momentum 0 moves the snapshot to the islands'
# mean, lr 2 to its mirror image beyond the mean; on a quadratic the distance to the optimum
# then scales by |1 - lr| per sync, which grows past 2 (1e300 overflowed at the first sync).
MAX_LR = 2.0


@dataclass(frozen=True)
class OuterOptions:
    """The `outer` section: islands of synchronous ZeRO joined by an outer optimizer
    (docs/arch/outer.md). `algorithm` none (the default) is plain synchronous data parallelism
    over all ranks; diloco runs the ZeRO engine inside each island of `island_nodes` nodes and
    every `sync_every` (H) inner steps averages the islands' pseudo-gradients (parameters at the
    last sync minus now) and applies Nesterov SGD (`lr`, `momentum`: DiLoCo's 0.7 and 0.9),
    moved in `quantize` format. With `start_iter` S > 0 the first S iterations train
    synchronously over all ranks (the warm start, in one job: `training/start_iter.py`).
    ConfigError naming the `outer` key for a value out of range or asking for what is not built."""

    algorithm: str = setting("none", "none (synchronous over all ranks) or diloco (islands + outer optimizer)")
    sync_every: int = setting(20, "H: inner steps between outer syncs")
    lr: float = setting(0.7, "outer learning rate (Nesterov SGD on the averaged pseudo-gradient)")
    momentum: float = setting(0.9, "outer Nesterov momentum")
    warmup_syncs: int = setting(
        0, "outer syncs over which the outer step ramps from plain averaging (lr 1, momentum 0) to lr and momentum"
    )
    fragments: int = setting(1, "streaming: fragments (runs of parameter tensors) synced at staggered steps, at most H")
    overlap_steps: int = setting(0, "streaming: inner steps an outer exchange runs before it is applied (tau, below H)")
    merge_alpha: float = setting(0.5, "with overlap: weight of the island's own parameters when an exchange is applied")
    quantize: str = setting(
        "none", "outer-gradient wire format: none (fp32), bf16, int4 (blocks of 256, error feedback)"
    )
    error_feedback: bool = setting(
        True, "int4 wire: add what the wire dropped back at the next sync (false: the ablation)"
    )
    island_nodes: int = setting(1, "nodes per island")
    exp_avg_every: int = setting(
        0, "average the inner AdamW's first moment across islands every k-th outer sync of a fragment (0: never)"
    )
    exp_avg_sq_every: int = setting(
        0, "average the inner AdamW's second moment across islands every k-th outer sync of a fragment (0: never)"
    )
    start_iter: int = setting(
        0,
        "S: synchronous data parallelism over all ranks for the first S iterations, islands from S on "
        "(0: islands from the start)",
    )

    def __post_init__(self) -> None:
        """ConfigError naming the `outer` key: an unknown algorithm, a setting given while
        two-level training is off (nothing would use it), or a value out of range."""
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"outer.algorithm = {self.algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
        if not self.enabled:
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
        if self.sync_every < 1:
            raise ConfigError(f"outer.sync_every = {self.sync_every}: expected at least 1 inner step per outer step")
        if not 0 < self.lr <= MAX_LR:
            raise ConfigError(
                f"outer.lr = {self.lr}: expected a value in (0, {MAX_LR}]: the outer step moves the islands' "
                f"last common parameters lr times as far as the islands moved on average (1: to their mean); "
                f"beyond {MAX_LR} it lands farther past that mean than it started from, so it diverges"
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum = {self.momentum}: expected a value in [0, 1)")
        if self.warmup_syncs < 0:
            raise ConfigError(f"outer.warmup_syncs = {self.warmup_syncs}: expected a number of outer syncs >= 0")
        if self.quantize not in QUANTIZE:
            raise ConfigError(f"outer.quantize = {self.quantize!r}: expected one of {', '.join(QUANTIZE)}")
        if self.island_nodes < 1:
            raise ConfigError(f"outer.island_nodes = {self.island_nodes}: expected a positive number of nodes")
        for key, every in self.averaged_state.items():
            if every < 0:
                raise ConfigError(
                    f"outer.{key}_every = {every}: expected 0 (keep each island's {key}) or every how "
                    f"many outer syncs of a fragment to average it across islands"
                )
        if self.start_iter < 0:
            raise ConfigError(
                f"outer.start_iter = {self.start_iter}: expected the iteration the islands start at, >= 0 "
                f"(0: from the start)"
            )
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

    @property
    def averaged_state(self) -> dict[str, int]:
        """The inner optimizer's state averaged across islands (DES-LOC, arXiv 2505.22549: the
        first moment every 3 syncs, the second every 6), by its name in the optimizer's state
        (`InnerEngine.moments`): every how many outer syncs of a fragment (0: never)."""
        return {"exp_avg": self.exp_avg_every, "exp_avg_sq": self.exp_avg_sq_every}

    @property
    def enabled(self) -> bool:
        """Whether two-level training is on (the run's options then carry these)."""
        return self.algorithm != "none"
