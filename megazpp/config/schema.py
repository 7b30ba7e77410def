"""The run's whole configuration as typed dataclasses, read from YAML, DeepSpeed JSON and flags.

Why this shape: one typed object that every part reads (instead of a bag of argparse
attributes) lets a wrong key, a wrong type or an inconsistent combination be refused here,
with the file and the closest valid name, before a process group or a tensor exists.

Every section is a frozen type that checks its own values when built, with each field's help
beside it (`megazpp.setting.setting`), so a setting is defined once: a subsystem below the config
owns its section (`zero`, `optimizer`, `precision`, `data`, `outer`, `parallel`; `model` is the
model's `ModelConfig`); the sections whose readers sit above the config (`training`,
`checkpoint`, `logging`; `planner`) are defined in this layer (`sections.py`, `planner.py`).
This module only gathers them and names their flags.

Precedence, lowest to highest: dataclass defaults < YAML (`--config`) < DeepSpeed JSON
(`--deepspeed_config`) < Megatron-style command-line flags. Every field of every section is
also a flag: `training.micro_batch_size` is `--micro-batch-size` (see `FLAG_NAMES` for the few
renamed ones), booleans take `--flag` / `--no-flag`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

import yaml

from megazpp.config.planner import PlannerSettings
from megazpp.config.sections import CheckpointOptions, LoggingOptions, TrainingOptions
from megazpp.data.options import DataOptions
from megazpp.errors import required
from megazpp.model.config import ModelConfig
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.settings import OuterOptions
from megazpp.parallel.options import ParallelOptions
from megazpp.setting import keys
from megazpp.zero.options import ZeroOptions


@dataclass
class Config:
    """Everything one run needs; `config.checks.validate_config(cfg, world_size)` checks it as a whole."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataOptions = field(default_factory=DataOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    zero: ZeroOptions = field(default_factory=ZeroOptions)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    outer: OuterOptions = field(default_factory=OuterOptions)

    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def num_micro_batches(self, world_size: int) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return required(self.training.global_batch_size, "training.global_batch_size") // (
            self.training.micro_batch_size * self.data_parallel_size(world_size)
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section's keys and values (what a YAML file could say; nothing derived)."""
        return {
            name: {f.name: _plain(getattr(getattr(self, name), f.name)) for f in keys(cls)}
            for name, cls in SECTIONS.items()
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    """A key's value as YAML writes it (a list copied, as `dataclasses.asdict` would)."""
    return list(value) if isinstance(value, list) else value


# every field of Config is a section whose default_factory is its class
SECTIONS: dict[str, type] = {f.name: cast(type, f.default_factory) for f in dataclasses.fields(Config)}

# Flags whose name is not simply the field name with dashes (clearer, or Megatron's spelling).
FLAG_NAMES: dict[str, str] = {
    "zero.stage": "--zero-stage",
    "planner.probe": "--planner-probe",
    "optimizer.name": "--optimizer",  # Megatron-LM's spelling
    **{f"outer.{f.name}": "--outer-" + f.name.replace("_", "-") for f in keys(OuterOptions)},
}


def flag_table() -> dict[str, tuple[str, str]]:
    """Map every flag to its (section, field); field names are unique across sections."""
    table: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in keys(cls):
            flag = FLAG_NAMES.get(f"{section}.{f.name}", "--" + f.name.replace("_", "-"))
            if flag in table:
                raise AssertionError(f"flag {flag} is defined by two config sections")
            table[flag] = (section, f.name)
    return table
