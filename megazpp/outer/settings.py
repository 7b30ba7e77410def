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
# the keys only elastic two-level training reads (docs/arch/elastic.md)
ELASTIC_KEYS = ("lighthouse", "island_id", "min_islands", "quorum_timeout_s", "sync_timeout_s", "train_samples")


@dataclass(frozen=True)
class OuterOptions:
    """The `outer` section: islands of synchronous ZeRO joined by an outer optimizer
    (docs/arch/outer.md). `algorithm` none (the default) is plain synchronous data parallelism
    over all ranks; diloco runs the ZeRO engine inside each island of `island_nodes` nodes and
    every `sync_every` (H) inner steps averages the islands' pseudo-gradients (parameters at the
    last sync minus now) and applies Nesterov SGD (`lr`, `momentum`), moved in `quantize`
    format. The defaults, lr 1 and momentum 0, are plain averaging (the islands' mean becomes
    the next start): measured from scratch on the 600-step LoCo schedule (docs/benchmarks.md,
    "Two-level training: choosing the defaults"), every outer momentum tried (DiLoCo's lr 0.7 /
    Nesterov 0.9, made for warm-started runs of hundreds of inner steps per sync, and lr 0.2-1.0
    with momentum 0.5-0.9, warmed up or not) ended worse than plain averaging, most by far.
    The inner optimizer's state is averaged at every sync by default (`optimizer_state_every` 1,
    measured there too: from scratch it closed 40% of plain averaging's gap to synchronous
    training at the price of the state's bytes, twice the pseudo-gradient's under AdamW).
    With `start_iter` S > 0 the first S iterations train synchronously over all ranks (the warm
    start, in one job: `training/start_iter.py`).
    ConfigError naming the `outer` key for a value out of range or asking for what is not built."""

    algorithm: str = setting("none", "none (synchronous over all ranks) or diloco (islands + outer optimizer)")
    sync_every: int = setting(20, "H: inner steps between outer syncs")
    lr: float = setting(
        1.0, "outer learning rate (Nesterov SGD on the averaged pseudo-gradient; 1 with momentum 0: their mean)"
    )
    momentum: float = setting(0.0, "outer Nesterov momentum (DiLoCo's published setting: lr 0.7, momentum 0.9)")
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
    elastic: bool = setting(
        False,
        "each island its own job, meeting at outer syncs over a membership that may change (docs/arch/elastic.md)",
    )
    lighthouse: str = setting(
        "", "elastic: HOST:PORT of the job's membership service (python -m megazpp.launch.lighthouse)"
    )
    island_id: int = setting(0, "elastic: this island's id, distinct among the job's islands")
    min_islands: int = setting(1, "elastic: the fewest live islands an outer sync waits for")
    quorum_timeout_s: float = setting(600.0, "elastic: how long an outer sync waits for min_islands islands")
    sync_timeout_s: float = setting(60.0, "elastic: how long an outer exchange waits for a peer before dropping it")
    train_samples: int = setting(
        0,
        "elastic: the job's train dataset in samples, one value on every island (checked at each sync); the "
        "islands' global sample order runs through it, pass after pass (0: this island's train_iters x global batch)",
    )
    optimizer_state_every: int = setting(
        1,
        "average the inner optimizer's state (AdamW's two moments, SGD's momentum buffer) across islands "
        "every k-th outer sync of a fragment (0: each island keeps its own)",
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
        if self.optimizer_state_every < 0:
            raise ConfigError(
                f"outer.optimizer_state_every = {self.optimizer_state_every}: expected 0 (each island keeps "
                f"its inner optimizer's state) or every how many outer syncs of a fragment to average it"
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
        self._check_elastic()

    def _check_elastic(self) -> None:
        """The elastic keys' own rules (ConfigError naming the key)."""
        given = [k for k in ELASTIC_KEYS if getattr(self, k) != getattr(OuterOptions, k)]
        if not self.elastic:
            if given:
                raise ConfigError(
                    f"outer.{given[0]} = {getattr(self, given[0])!r} is an elastic setting and outer.elastic "
                    f"is false: set outer.elastic true (--outer-elastic) or drop the setting"
                )
            return
        host, _, port = self.lighthouse.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"outer.lighthouse = {self.lighthouse!r}: outer.elastic needs the membership service's "
                f"HOST:PORT (--outer-lighthouse, the port python -m megazpp.launch.lighthouse listens on)"
            )
        if self.island_id < 0:
            raise ConfigError(f"outer.island_id = {self.island_id}: expected an id >= 0")
        if self.min_islands < 1:
            raise ConfigError(f"outer.min_islands = {self.min_islands}: expected at least 1 island per outer sync")
        if self.train_samples < 0:
            raise ConfigError(
                f"outer.train_samples = {self.train_samples}: expected a number of samples >= 1 (0: the default)"
            )
        for key in ("quorum_timeout_s", "sync_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"outer.{key} = {getattr(self, key)}: expected a positive number of seconds")
        unbuilt = [
            f"outer.{k} = {getattr(self, k)!r}"
            for k in (
                "fragments",
                "overlap_steps",
                "quantize",
                "island_nodes",
                "start_iter",
            )
            if getattr(self, k) != getattr(OuterOptions, k)
        ]
        if unbuilt:
            raise ConfigError(
                f"{unbuilt[0]} with outer.elastic: an elastic island syncs its whole shard in fp32 at once "
                f"and is its job's whole world from the start (streaming, compressed wires, island_nodes and "
                f"start_iter are not built for it yet, docs/arch/elastic.md): drop the setting"
            )

    @property
    def enabled(self) -> bool:
        """Whether two-level training is on (the run's options then carry these)."""
        return self.algorithm != "none"
