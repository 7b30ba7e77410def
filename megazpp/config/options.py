"""The run's checked options: the config as `config.checks.check_config` resolved it.

Why a type of its own: the loader's `Config` holds what the sources said (a global batch size
may be absent, a warmup given as a fraction); the check resolves those from the world size and
the other sections into a new Config, leaving its input untouched, and every part of a rank
(the engine builder, the trainer, the logger, the banner) reads this one, never the loader's.
Each section is its subsystem's own type, checked when built (`zero.options.ZeroOptions`,
`optim.options.OptimizerOptions` / `PrecisionOptions`, `outer.settings.OuterOptions`,
`data.options.DataOptions`), so nothing here maps or checks a setting again.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazpp.config.schema import Config
from megazpp.config.sections import TrainingOptions
from megazpp.data.options import DataOptions
from megazpp.errors import required
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.settings import OuterOptions
from megazpp.zero.options import ZeroOptions


@dataclass(frozen=True)
class RunOptions:
    """Every section of one run, checked and resolved once before any rank starts: the global
    batch size and warmup iterations set (`training`), the `zero` options told the micro-batch
    count and narrowed by the other sections' rules."""

    config: Config
    world_size: int

    @property
    def training(self) -> TrainingOptions:
        """The `training` section with the global batch size and the warmup iterations resolved."""
        return self.config.training

    @property
    def zero(self) -> ZeroOptions:
        return self.config.zero

    @property
    def optimizer(self) -> OptimizerOptions:
        return self.config.optimizer

    @property
    def precision(self) -> PrecisionOptions:
        return self.config.precision

    @property
    def data(self) -> DataOptions:
        return self.config.data

    @property
    def outer(self) -> OuterOptions | None:
        """The `outer` options when two-level training is on, else None."""
        return self.config.outer if self.config.outer.enabled else None

    @property
    def global_batch_size(self) -> int:
        return required(self.config.training.global_batch_size, "training.global_batch_size")

    @property
    def train_samples(self) -> int:
        """The train dataset's samples: `train_iters` x the global batch, or an elastic job's
        `outer.train_samples` when set (one dataset for every island, whose global sample order
        runs through it: docs/arch/elastic.md)."""
        outer = self.outer
        if outer is not None and outer.train_samples:
            return outer.train_samples
        return self.config.training.train_iters * self.global_batch_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.config.num_micro_batches(self.world_size)

    @property
    def uses_zero_engine(self) -> bool:
        """The ZeRO engine runs when data parallel or when a zero stage / PaRO strategy is asked
        for (stage 0 over dp > 1 is NNN: plain DDP); else LocalEngine."""
        return self.zero.runs_engine(self.config.data_parallel_size(self.world_size))
