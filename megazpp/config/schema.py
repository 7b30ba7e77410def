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

from megazpp.config.planner import PlannerSettings
from megazpp.data.options import DataOptions
from megazpp.errors import ConfigError, required
from megazpp.model.config import ModelConfig
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.settings import OuterOptions
from megazpp.setting import keys, setting
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zeropp import ZeroPP


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

    stage: int = setting(0, "ZeRO stage 0-3 (aliases of PaRO NNN, NNG, NGG, GGG)")
    paro_strategy: str | None = setting(None, "PaRO triple (e.g. NIG, III) or auto (the planner picks)")
    paro_group_size: int | None = setting(ZeroOptions.paro_group_size, "ranks of a PaRO I group; none: the node")
    reduce_bucket_size: int = setting(
        ZeroOptions.reduce_bucket_size, "elements per gradient bucket (also bounds a fetch group)"
    )
    allgather_bucket_size: int = setting(
        ZeroOptions.allgather_bucket_size, "elements per parameter fetch group at most"
    )
    contiguous_gradients: bool = setting(True, "always on (flat buckets)")
    # DeepSpeed's: on for stage 3 only; false: no prefetch, reductions waited at once
    overlap_comm: bool = setting(
        ZeroOptions.overlap_comm, "prefetch groups and overlap reductions with backward; false: wait each at once"
    )
    reduce_scatter: bool = setting(True, "always on (gradients reduced to their shard level)")
    zero_quantized_weights: bool = setting(ZeroPP.qwz, "qwZ: int8 parameter all-gather")
    zero_hpz_partition_size: int = setting(ZeroPP.hpz, "hpZ: ranks of the node-local secondary parameter copy")
    zero_quantized_gradients: bool = setting(ZeroPP.qgz, "qgZ: int4 gradient all-to-all")
    loco: bool = setting(ZeroPP.loco, "LoCo error feedback for qgZ")
    loco_err_beta: float = setting(ZeroPP.err_beta, "LoCo error decay")
    loco_reset_t: int = setting(ZeroPP.reset_t, "LoCo buffer reset period (steps)")
    module_granularity_threshold: int = setting(
        ZeroOptions.module_granularity_threshold, "fetch modules finer than this whole (coalesced)"
    )
    # parameter fetch (p sharded): groups, prefetch depth and reuse, DeepSpeed's meanings
    fetch_groups: str = setting(
        ZeroOptions.fetch_groups,
        "layer (one fetch group per transformer layer) or size (execution-order, bounded in elements)",
    )  # megazpp's own: "layer" or "size" (see megazpp.zero.units)
    stage3_prefetch_bucket_size: int = setting(
        ZeroOptions.stage3_prefetch_bucket_size, "elements of fetch groups gathered ahead of use"
    )  # elements gathered ahead of use
    stage3_max_live_parameters: int = setting(
        ZeroOptions.stage3_max_live_parameters,
        "elements kept gathered from forward to backward (0: re-gather in backward)",
    )  # kept gathered forward -> backward
    stage3_max_reuse_distance: int = setting(
        ZeroOptions.stage3_max_reuse_distance, "keep a group for backward only if reused within this many elements"
    )  # kept if reused within this many
    # parameters of fewer elements stay whole on every rank (p sharded); 0: none (DeepSpeed: 1e5)
    stage3_param_persistence_threshold: int = setting(
        ZeroOptions.stage3_param_persistence_threshold,
        "parameters of fewer elements stay whole on every rank, refreshed after each step in one collective (0: none)",
    )
    # megazpp's own: G-level collectives in two stages: auto / always / never
    hierarchical: str = setting(
        "auto", "two-stage (node, then across nodes) collectives: auto (the planner prices them), always or never"
    )
    cpu_quant_kernels: str = setting(
        ZeroPP.cpu_kernels, "reference or compiled (TorchInductor) quantizers on CPU"
    )  # megazpp's own: "compiled" fuses the CPU quantizers
    qwz_block_size: int = setting(
        ZeroPP.qwz_block, "values per int8 scale in qwZ"
    )  # megazpp's own: values per int8 scale in qwZ's gathers
    qgz_block_size: int = setting(
        ZeroPP.qgz_block, "values per int4 scale in qgZ"
    )  # megazpp's own: values per int4 scale in qgZ's all-to-alls


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
    zero: ZeroConfig = field(default_factory=ZeroConfig)
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
