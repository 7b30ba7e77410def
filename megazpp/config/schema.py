"""The run's whole configuration as typed dataclasses, read from YAML, DeepSpeed JSON and flags.

Why this shape: one typed object that every part reads (instead of a bag of argparse
attributes) lets a wrong key, a wrong type or an inconsistent combination be refused here,
with the file and the closest valid name, before a process group or a tensor exists.

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

from megazpp.data.options import DataOptions
from megazpp.errors import ConfigError, required
from megazpp.model.config import ModelConfig
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.settings import OuterSettings
from megazpp.planner.settings import PlannerSettings
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zeropp import ZeroPP


@dataclass
class DataConfig:
    """Where samples come from. `data_path` is Megatron's list: ["P"] or ["0.7", "A", "0.3", "B"].
    Read into `megazpp.data.options.DataOptions` (its defaults, its parsing and checks) by field name."""

    data_path: list[str] = field(default_factory=list)
    split: str = DataOptions.split
    tokenizer_model: str | None = DataOptions.tokenizer_model
    # The embedding is padded to a multiple of this (times TP) so matmuls stay aligned, as in
    # Megatron; the model's vocab_size is derived from the tokenizer unless set explicitly.
    make_vocab_size_divisible_by: int = DataOptions.make_vocab_size_divisible_by
    # Preprocessing records which tokenizer made a dataset (data/tokenizer_record.py); a dataset
    # made by another one than tokenizer_model is refused before any rank starts unless this is set.
    allow_tokenizer_mismatch: bool = DataOptions.allow_tokenizer_mismatch


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters; `clip_grad` 0 disables clipping. Read into
    `megazpp.optim.options.OptimizerOptions` (its defaults, its checks) by field name."""

    lr: float = OptimizerOptions.lr
    min_lr: float = OptimizerOptions.min_lr
    weight_decay: float = OptimizerOptions.weight_decay
    adam_beta1: float = OptimizerOptions.adam_beta1
    adam_beta2: float = OptimizerOptions.adam_beta2
    adam_eps: float = OptimizerOptions.adam_eps
    clip_grad: float = OptimizerOptions.clip_grad


@dataclass
class TrainingConfig:
    """Batching, length of the run, learning-rate shape, evaluation cadence and seeding.

    `global_batch_size` None means one micro-batch per data-parallel rank per step, or
    micro x `gradient_accumulation_steps` x dp when the latter is given (DeepSpeed style).
    `seed` drives data order and dropout; parameter init uses `model.init_seed`.
    """

    micro_batch_size: int = 4
    global_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    train_iters: int = 100
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None  # Megatron's: warmup as a fraction of the decay
    lr_decay_iters: int | None = None  # None: decay over the whole run (train_iters)
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    eval_interval: int = 100
    eval_iters: int = 10
    seed: int = 1234
    # Numerical faults (bf16 / fp32; fp16 overflow is the loss scaler's business): a step
    # with a non-finite loss or gradient norm is skipped; this many in a row stop the run.
    max_bad_steps: int = 5
    # A loss above factor x the mean of the last `loss_spike_window` good losses is logged as
    # a spike (TensorBoard `train/loss_spike`); 0 turns spike detection off.
    loss_spike_factor: float = 3.0
    loss_spike_window: int = 50
    # What trains (megazpp.model.trainable): name globs or last:N; empty: everything, or only
    # the adapters when model.lora_rank > 0 (patterns then add to the adapters)
    trainable: list[str] = field(default_factory=list)
    # torch.compile each transformer layer (megazpp.model.compile); the first steps pay for it
    compile: bool = False
    # Start even when the planner's memory estimate per rank exceeds the free memory
    # (megazpp.training.memory_check); a launch guard, not a setting of the run's state.
    skip_memory_check: bool = False


@dataclass
class PrecisionConfig:
    """Model dtype and, for fp16, the loss scaler (DeepSpeed's `fp16` block maps here).

    `loss_scale` 0 means dynamic: start at `initial_loss_scale`, halve on overflow (after
    `hysteresis` consecutive overflows), double after `loss_scale_window` good steps.
    `grad_accum_dtype` is the dtype micro-batch gradients are summed in under bf16/fp16.
    Read into `megazpp.optim.options.PrecisionOptions` (its defaults, its checks) by field name.
    """

    bf16: bool = PrecisionOptions.bf16
    fp16: bool = PrecisionOptions.fp16
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = PrecisionOptions.grad_accum_dtype
    loss_scale: float = PrecisionOptions.loss_scale
    initial_loss_scale: float = PrecisionOptions.initial_loss_scale
    min_loss_scale: float = PrecisionOptions.min_loss_scale
    loss_scale_window: int = PrecisionOptions.loss_scale_window
    hysteresis: int = PrecisionOptions.hysteresis


@dataclass
class CheckpointConfig:
    """Megatron's checkpoint flags: `exit_interval` N stops after step N (saving if `save`).

    With `save` and no `load`, a run resumes from `save`'s latest checkpoint if it has one,
    so a job restarted by its launcher continues where it stopped.
    """

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    # Stop (saving if `save`) after the first step that ends this many minutes after the
    # program started, as Megatron's --exit-duration-in-mins; SIGTERM / SIGINT stop the same way.
    exit_duration_in_mins: float | None = None
    # Load the next older complete checkpoint when the newest is refused (never by default:
    # silently losing progress is worse than stopping to look).
    load_fallback: bool = False
    # `load` naming no checkpoint is an error (a mistyped path would start from scratch and
    # overwrite `save`'s checkpoints) unless this is set.
    load_optional: bool = False
    # Allow a run that starts below the newest checkpoint in `save` to move `latest` back.
    overwrite_newer_checkpoints: bool = False
    # Save only the trainable parameters (LoRA adapters, `training.trainable`) and their state;
    # the frozen base is reloaded from the import or init the run started from (frozen_base.py).
    save_adapters_only: bool = False


@dataclass
class LoggingConfig:
    tensorboard_dir: str | None = None
    log_interval: int = 10


@dataclass
class ParallelConfig:
    """Parallel layout; dp = world_size / (tp x pp) is derived, never set."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    ranks_per_node: int | None = None  # None: from the launcher (LOCAL_WORLD_SIZE)
    distributed_timeout_minutes: int = 10
    # auto: NCCL on CUDA ranks (one GPU each), gloo on CPU ranks; gloo on CUDA lets several
    # ranks share a GPU (megazpp.parallel.device)
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"


@dataclass
class ZeroConfig:
    """The data-parallel optimizer: a PaRO strategy or a ZeRO stage, plus ZeRO++ switches.

    Field names follow DeepSpeed's `zero_optimization` keys so its JSON maps one to one, and
    mean what they mean there. The defaults of DeepSpeed's keys are DeepSpeed 0.19.8's except
    two: `overlap_comm` is on at every stage (DeepSpeed, when the key is absent: on for stage 3
    only), because this engine overlaps alike under every strategy and false only serializes
    it; `stage3_param_persistence_threshold` is 0 (DeepSpeed: 1e5), because with layer fetch
    groups small tensors already travel in their layer's one collective, and a threshold is
    refused with p = N strategies (stages 0-2) and with frozen parameters. The fields marked
    "megazpp's own" (and `paro_strategy`, `paro_group_size`) have no DeepSpeed default. A value
    other than the default for a feature listed in `NOT_IMPLEMENTED_YET` is refused.
    `config.checks.check_config` maps this section by field name onto zero's own `ZeroOptions`
    and `ZeroPP` (whose defaults these are, and which check every rule of the section), once,
    before any rank starts; docs/arch/zero.md ("Where each rule is checked") says which module
    checks each rule. With stage 0 and no
    `paro_strategy`, a data-parallel run uses strategy NNN (plain DDP). `paro_strategy: auto`
    lets the planner choose at start-up from the `planner` section (docs/planning.md).
    """

    stage: int = 0
    paro_strategy: str | None = None
    paro_group_size: int | None = ZeroOptions.paro_group_size
    reduce_bucket_size: int = ZeroOptions.reduce_bucket_size
    allgather_bucket_size: int = ZeroOptions.allgather_bucket_size
    contiguous_gradients: bool = True
    overlap_comm: bool = (
        ZeroOptions.overlap_comm
    )  # DeepSpeed's: on for stage 3 only; false: no prefetch, reductions waited at once
    reduce_scatter: bool = True
    zero_quantized_weights: bool = ZeroPP.qwz
    zero_hpz_partition_size: int = ZeroPP.hpz
    zero_quantized_gradients: bool = ZeroPP.qgz
    loco: bool = ZeroPP.loco
    loco_err_beta: float = ZeroPP.err_beta
    loco_reset_t: int = ZeroPP.reset_t
    module_granularity_threshold: int = ZeroOptions.module_granularity_threshold
    # parameter fetch (p sharded): groups, prefetch depth and reuse, DeepSpeed's meanings
    fetch_groups: str = ZeroOptions.fetch_groups  # megazpp's own: "layer" or "size" (see megazpp.zero.units)
    stage3_prefetch_bucket_size: int = ZeroOptions.stage3_prefetch_bucket_size  # elements gathered ahead of use
    stage3_max_live_parameters: int = ZeroOptions.stage3_max_live_parameters  # kept gathered forward -> backward
    stage3_max_reuse_distance: int = ZeroOptions.stage3_max_reuse_distance  # kept if reused within this many
    # parameters of fewer elements stay whole on every rank (p sharded); 0: none (DeepSpeed: 1e5)
    stage3_param_persistence_threshold: int = ZeroOptions.stage3_param_persistence_threshold
    # megazpp's own: G-level collectives in two stages: auto / always / never
    hierarchical: str = "auto"
    cpu_quant_kernels: str = ZeroPP.cpu_kernels  # megazpp's own: "compiled" fuses the CPU quantizers
    qwz_block_size: int = ZeroPP.qwz_block  # megazpp's own: values per int8 scale in qwZ's gathers
    qgz_block_size: int = ZeroPP.qgz_block  # megazpp's own: values per int4 scale in qgZ's all-to-alls


@dataclass
class Config:
    """Everything one run needs; `config.checks.validate_config(cfg, world_size)` checks it as a whole."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    outer: OuterSettings = field(default_factory=OuterSettings)

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
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# every field of Config is a section whose default_factory is its class
SECTIONS: dict[str, type] = {f.name: cast(type, f.default_factory) for f in dataclasses.fields(Config)}

# Features that are configured here but not executed yet. A field listed here with a value
# other than its default is refused with "not implemented yet" (by the loader, naming where the
# value came from, and by `config.checks.validate_config`); remove the entry in the same commit
# that makes the feature work.
NOT_IMPLEMENTED_YET: dict[str, str] = {
    "zero.contiguous_gradients": "ZeRO without contiguous gradient buffers (buckets are flat)",
    "zero.reduce_scatter": "ZeRO reducing gradients by all-reduce instead of reduce-scatter to their shard level",
}


def refuse_not_implemented(cfg: Config, origins: dict[str, str] | None = None) -> None:
    for dotted, feature in NOT_IMPLEMENTED_YET.items():
        section, name = dotted.split(".")
        obj = getattr(cfg, section)
        default = next(f for f in dataclasses.fields(obj) if f.name == name).default
        if getattr(obj, name) != default:
            source = (origins or {}).get(dotted)
            prefix = f"{source}: " if source else ""
            raise ConfigError(f"{prefix}{dotted} = {getattr(obj, name)!r}: {feature} is not implemented yet")


# Flags whose name is not simply the field name with dashes (clearer, or Megatron's spelling).
FLAG_NAMES: dict[str, str] = {
    "zero.stage": "--zero-stage",
    "planner.probe": "--planner-probe",
    **{f"outer.{f.name}": "--outer-" + f.name.replace("_", "-") for f in dataclasses.fields(OuterSettings)},
}


def flag_table() -> dict[str, tuple[str, str]]:
    """Map every flag to its (section, field); field names are unique across sections."""
    table: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            flag = FLAG_NAMES.get(f"{section}.{f.name}", "--" + f.name.replace("_", "-"))
            if flag in table:
                raise AssertionError(f"flag {flag} is defined by two config sections")
            table[flag] = (section, f.name)
    return table
