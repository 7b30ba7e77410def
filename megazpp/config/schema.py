"""The run's whole configuration as typed dataclasses, read from YAML, DeepSpeed JSON and flags.

Why this shape: one typed object that every part reads (instead of a bag of argparse
attributes) lets a wrong key, a wrong type or an inconsistent combination be refused here,
with the file and the closest valid name, before a process group or a tensor exists.

Each section a subsystem owns is that subsystem's own frozen type, checked when built (`zero`,
`optimizer`, `precision`, `data`, `outer`; `model` is the model's `ModelConfig`), so a setting is
defined once, with its help beside it (`megazpp.setting.setting`); the sections only the run
reads (`training`, `checkpoint`, `logging`, `parallel`) are defined here.

Precedence, lowest to highest: dataclass defaults < YAML (`--config`) < DeepSpeed JSON
(`--deepspeed_config`) < Megatron-style command-line flags. Every field of every section is
also a flag: `training.micro_batch_size` is `--micro-batch-size` (see `FLAG_NAMES` for the few
renamed ones), booleans take `--flag` / `--no-flag`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import yaml

from megazpp.config.planner import PlannerSettings
from megazpp.data.options import DataOptions
from megazpp.errors import required
from megazpp.model.config import ModelConfig
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.settings import OuterOptions
from megazpp.setting import keys, setting
from megazpp.zero.options import ZeroOptions


@dataclass
class TrainingConfig:
    """Batching, length of the run, learning-rate shape, evaluation cadence and seeding.

    `global_batch_size` None means one micro-batch per data-parallel rank per step, or
    micro x `gradient_accumulation_steps` x dp when the latter is given (DeepSpeed style).
    `seed` drives data order and dropout; parameter init uses `model.init_seed`.
    """

    micro_batch_size: int = setting(4, "samples per rank per forward/backward")
    global_batch_size: int | None = setting(None, "samples per optimizer step; none: micro x dp")
    gradient_accumulation_steps: int | None = setting(
        None, "micro-batches per step (DeepSpeed style; sets the global batch)"
    )
    train_iters: int = setting(100, "optimizer steps of the run")
    lr_warmup_iters: int = setting(0, "linear warmup steps (a config file's warmup is scaled to a shorter run)")
    lr_warmup_fraction: float | None = setting(
        None, "warmup as a fraction of the decay length (instead of lr_warmup_iters)"
    )  # Megatron's: warmup as a fraction of the decay
    lr_decay_iters: int | None = setting(
        None, "decay length; none: train_iters"
    )  # None: decay over the whole run (train_iters)
    lr_decay_style: Literal["cosine", "linear", "constant"] = setting("cosine", "cosine, linear or constant")
    eval_interval: int = setting(100, "evaluate every N steps (and at the last)")
    eval_iters: int = setting(10, "validation batches per evaluation (0: none)")
    seed: int = setting(1234, "data order and dropout")
    # Numerical faults (bf16 / fp32; fp16 overflow is the loss scaler's business): a step
    # with a non-finite loss or gradient norm is skipped; this many in a row stop the run.
    max_bad_steps: int = setting(5, "stop after N consecutive non-finite steps")
    # A loss above factor x the mean of the last `loss_spike_window` good losses is logged as
    # a spike (TensorBoard `train/loss_spike`); 0 turns spike detection off.
    loss_spike_factor: float = setting(3.0, "log a spike above this x the recent mean loss (0: off)")
    loss_spike_window: int = setting(50, "good steps in the recent mean")
    # What trains (megazpp.model.trainable): name globs or last:N; empty: everything, or only
    # the adapters when model.lora_rank > 0 (patterns then add to the adapters)
    trainable: list[str] = setting(
        [], "what trains: name globs (*norm* *.bias layers.7.*) or last:N layers; empty: all (LoRA: adapters)"
    )
    # torch.compile each transformer layer (megazpp.model.compile); the first steps pay for it
    compile: bool = setting(
        False,
        "torch.compile each transformer layer (rotary in real arithmetic); the first steps compile; needs whole "
        "parameters (zero.stage <= 2 or PaRO N**)",
    )
    # Start even when the planner's memory estimate per rank exceeds the free memory
    # (megazpp.training.memory_check); a launch guard, not a setting of the run's state.
    skip_memory_check: bool = setting(False, "start even when the estimated memory per rank exceeds the free memory")


@dataclass
class CheckpointConfig:
    """Megatron's checkpoint flags: `exit_interval` N stops after step N (saving if `save`).

    With `save` and no `load`, a run resumes from `save`'s latest checkpoint if it has one,
    so a job restarted by its launcher continues where it stopped.
    """

    save: str | None = setting(None, "save directory (also resumed from: see the README's resume rule)")
    load: str | None = setting(None, "continue the run whose checkpoint is here, whatever its settings")
    save_interval: int | None = setting(None, "save every N steps (and at the last)")
    exit_interval: int | None = setting(None, "stop after step N, saving first")
    # Stop (saving if `save`) after the first step that ends this many minutes after the
    # program started, as Megatron's --exit-duration-in-mins; SIGTERM / SIGINT stop the same way.
    exit_duration_in_mins: float | None = setting(
        None, "stop (saving first) after the step that ends this many minutes after start"
    )
    # Load the next older complete checkpoint when the newest is refused (never by default:
    # silently losing progress is worse than stopping to look).
    load_fallback: bool = setting(False, "load the previous complete checkpoint if the newest is refused")
    # `load` naming no checkpoint is an error (a mistyped path would start from scratch and
    # overwrite `save`'s checkpoints) unless this is set.
    load_optional: bool = setting(False, "a --load holding no checkpoint starts from scratch instead of being refused")
    # Allow a run that starts below the newest checkpoint in `save` to move `latest` back.
    overwrite_newer_checkpoints: bool = setting(
        False, "allow a run starting below --save's newest checkpoint to move latest back"
    )
    # Save only the trainable parameters (LoRA adapters, `training.trainable`) and their state;
    # the frozen base is reloaded from the import or init the run started from (frozen_base.py).
    save_adapters_only: bool = setting(
        False,
        "save only what trains (LoRA adapters, training.trainable) and its state; resuming reloads the recorded "
        "frozen base",
    )


@dataclass
class LoggingConfig:
    tensorboard_dir: str | None = setting(None, "TensorBoard event directory (none: console only)")
    log_interval: int = setting(10, "console line and TensorBoard points every N steps")


@dataclass
class ParallelConfig:
    """Parallel layout; dp = world_size / (tp x pp) is derived, never set."""

    tensor_model_parallel_size: int = setting(1, "tensor-parallel ranks")
    pipeline_model_parallel_size: int = setting(1, "pipeline stages")
    sequence_parallel: bool = setting(False, "split norms and dropout over the tensor-parallel ranks")
    ranks_per_node: int | None = setting(
        None, "ranks per (virtual) node; none: the launcher's"
    )  # None: from the launcher (LOCAL_WORLD_SIZE)
    distributed_timeout_minutes: int = setting(10, "a collective waiting longer fails")
    # auto: NCCL on CUDA ranks (one GPU each), gloo on CPU ranks; gloo on CUDA lets several
    # ranks share a GPU (megazpp.parallel.device)
    distributed_backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto",
        "auto (nccl on GPUs, gloo on CPUs), nccl, or gloo (also on CUDA: several ranks may then share one GPU, round "
        "robin)",
    )


@dataclass
class Config:
    """Everything one run needs; `config.checks.validate_config(cfg, world_size)` checks it as a whole."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataOptions = field(default_factory=DataOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
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
