"""Whole-config consistency checks, run by `validate_config` once every source is merged.

Why apart from the schema and the loader: these rules read only the finished dataclass values
(never YAML, flags or their origins), so they stay readable as one list of refusals, each a
`ConfigError` naming the key, the value and what was expected, raised before any work starts.
They also know the ZeRO engine's vocabulary (strategy names, fetch-group and hierarchy modes),
so they sit above `megazpp.zero`, while the schema (`megazpp.config`) sits below it.
"""

from __future__ import annotations

from kernels.api import check_cpu_kernels
from kernels.format import check_block_size, check_err_beta
from megazpp.config.load import validate_types
from megazpp.config.schema import Config, PrecisionConfig, ZeroConfig, refuse_not_implemented
from megazpp.data.builder import parse_split
from megazpp.errors import ConfigError, TopologyError
from megazpp.model.trainable import trainable_fraction, trainable_rule
from megazpp.outer.settings import OuterOptions
from megazpp.parallel.topology import island_layout
from megazpp.zero.frozen import check_frozen_support
from megazpp.zero.strategy import Level, resolve_strategy
from megazpp.zero.traffic import HIERARCHY_MODES
from megazpp.zero.units import FETCH_GROUP_MODES, check_persistence


def validate_config(cfg: Config, world_size: int = 1) -> Config:
    """Refuse the first inconsistent value; resolve the derived batch sizes; return `cfg`."""
    validate_types(cfg)
    cfg.model.validate()
    _validate_parallel(cfg, world_size)
    _resolve_batch(cfg, world_size)
    _validate_schedule(cfg)
    _validate_precision(cfg.precision)
    _validate_zero(cfg.zero)
    cfg.planner.validate()
    if cfg.training.trainable:
        trainable_rule(cfg.training.trainable, cfg.model)  # refuses a pattern that matches nothing
    z = cfg.zero
    if (
        str(z.paro_strategy).lower() != "auto"
        and (cfg.model.lora_rank or cfg.training.trainable)
        and trainable_fraction(cfg.model, cfg.training.trainable) < 1
    ):
        check_frozen_support(
            resolve_strategy(z.paro_strategy, z.stage),
            z.zero_quantized_weights,
            z.zero_hpz_partition_size,
            z.stage3_param_persistence_threshold,
        )
    if cfg.training.compile:
        _check_compile(z)
    if cfg.checkpoint.save_adapters_only and not (cfg.model.lora_rank or cfg.training.trainable):
        raise ConfigError(
            "checkpoint.save_adapters_only: every parameter trains (model.lora_rank is 0 "
            "and training.trainable is empty), so there is no frozen base to leave out"
        )
    refuse_not_implemented(cfg)
    return cfg


def _check_compile(z: ZeroConfig) -> None:
    """training.compile needs every layer's parameters resident: a strategy that shards them
    (p = I or G) swaps each parameter's storage for a gathered one and back around every call,
    and a compiled graph keeps the shapes it was traced with (under ZeRO-3 the first released
    parameter fails Inductor's size check), so that pairing is refused before any rank starts."""
    if str(z.paro_strategy).lower() == "auto":
        raise ConfigError(
            "training.compile with zero.paro_strategy = auto: the planner may choose a strategy "
            "that shards parameters, which compiled layers cannot follow; name a strategy whose "
            "parameters stay whole (zero.stage 0, 1 or 2, or a PaRO strategy N**)"
        )
    strategy = resolve_strategy(z.paro_strategy, z.stage)
    if strategy.params != Level.N:
        raise ConfigError(
            f"training.compile with strategy {strategy.name}: its parameters are sharded "
            f"({strategy.params.name}) and gathered around each layer call, which a compiled layer "
            "cannot follow (it keeps the shapes it was traced with); use zero.stage 0, 1 or 2 "
            "(or a PaRO strategy N**), or drop --compile"
        )


def _require_positive(where: str, value: int | float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{where} = {value!r}: expected a value > 0")


def _validate_parallel(cfg: Config, world_size: int) -> None:
    p = cfg.parallel
    _require_positive("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size)
    _require_positive("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size)
    _require_positive("parallel.ranks_per_node", p.ranks_per_node)
    _require_positive("parallel.distributed_timeout_minutes", p.distributed_timeout_minutes)
    if p.sequence_parallel and cfg.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel = true needs "
            "parallel.tensor_model_parallel_size > 1 (it splits the sequence "
            "over the tensor-parallel ranks)"
        )
    if world_size % (cfg.tp * cfg.pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {cfg.tp} "
            f"x pipeline_model_parallel_size {cfg.pp}"
        )


def _resolve_batch(cfg: Config, world_size: int) -> None:
    t = cfg.training
    dp = cfg.data_parallel_size(world_size)
    _require_positive("training.micro_batch_size", t.micro_batch_size)
    _require_positive("training.gradient_accumulation_steps", t.gradient_accumulation_steps)
    per_step = t.micro_batch_size * dp
    if t.gradient_accumulation_steps is not None:
        implied = per_step * t.gradient_accumulation_steps
        if t.global_batch_size is not None and t.global_batch_size != implied:
            raise ConfigError(
                f"training.global_batch_size = {t.global_batch_size} disagrees with "
                f"micro_batch_size {t.micro_batch_size} x gradient_accumulation_steps "
                f"{t.gradient_accumulation_steps} x data-parallel size {dp} = {implied}"
            )
        t.global_batch_size = implied
    if t.global_batch_size is None:
        t.global_batch_size = per_step
    _require_positive("training.global_batch_size", t.global_batch_size)
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} is not divisible by "
            f"micro_batch_size {t.micro_batch_size} x data-parallel size {dp} = {per_step}"
        )


def _validate_schedule(cfg: Config) -> None:
    t, o = cfg.training, cfg.optimizer
    for key in ("train_iters", "eval_interval", "lr_decay_iters"):
        _require_positive(f"training.{key}", getattr(t, key))
    _require_positive("logging.log_interval", cfg.logging.log_interval)
    _require_positive("checkpoint.save_interval", cfg.checkpoint.save_interval)
    _require_positive("checkpoint.exit_interval", cfg.checkpoint.exit_interval)
    _require_positive("checkpoint.exit_duration_in_mins", cfg.checkpoint.exit_duration_in_mins)
    _require_positive("training.max_bad_steps", t.max_bad_steps)
    _require_positive("training.loss_spike_window", t.loss_spike_window)
    if t.loss_spike_factor != 0 and t.loss_spike_factor <= 1:
        raise ConfigError(f"training.loss_spike_factor = {t.loss_spike_factor}: expected 0 (off) or a factor > 1")
    if t.eval_iters < 0 or t.lr_warmup_iters < 0:
        raise ConfigError(
            f"training.eval_iters and training.lr_warmup_iters must be >= 0, got {t.eval_iters} and {t.lr_warmup_iters}"
        )
    decay_iters = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_fraction is not None:
        if not 0 <= t.lr_warmup_fraction <= 1:
            raise ConfigError(f"training.lr_warmup_fraction = {t.lr_warmup_fraction}: expected a fraction in [0, 1]")
        if t.lr_warmup_iters:
            raise ConfigError(
                f"training.lr_warmup_fraction = {t.lr_warmup_fraction} and "
                f"training.lr_warmup_iters = {t.lr_warmup_iters} are both set: "
                "give one"
            )
        # resolved once into iterations, which is what the schedule and checkpoints record
        t.lr_warmup_iters = round(t.lr_warmup_fraction * decay_iters)
        t.lr_warmup_fraction = None
    if t.lr_warmup_iters > decay_iters:
        raise ConfigError(
            f"training.lr_warmup_iters = {t.lr_warmup_iters} exceeds the decay "
            f"length (lr_decay_iters or train_iters) = {decay_iters}"
        )
    if not o.lr > 0:
        raise ConfigError(
            f"optimizer.lr (--lr) = {o.lr:g}: expected a learning rate > 0 (a negative "
            "one would climb the loss; 0 would not train)"
        )
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr = {o.min_lr} must lie in [0, optimizer.lr = {o.lr}]")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optimizer.{key} = {getattr(o, key)}: expected a value in [0, 1)")
    _require_positive("optimizer.adam_eps", o.adam_eps)
    if o.weight_decay < 0 or o.clip_grad < 0:
        raise ConfigError(
            f"optimizer.weight_decay and optimizer.clip_grad must be >= 0, got {o.weight_decay} and {o.clip_grad}"
        )
    parse_split(cfg.data.split, "data.split")


def _validate_precision(p: PrecisionConfig) -> None:
    if p.bf16 and p.fp16:
        raise ConfigError("precision.bf16 and precision.fp16 are both set: choose one")
    model_dtype = "bf16" if p.bf16 else "fp16" if p.fp16 else "fp32"
    if p.grad_accum_dtype not in ("fp32", model_dtype):
        raise ConfigError(
            f"precision.grad_accum_dtype = {p.grad_accum_dtype!r} with a {model_dtype} model: "
            f"expected 'fp32' or the model dtype {model_dtype!r}"
        )
    if p.loss_scale < 0:
        raise ConfigError(f"precision.loss_scale = {p.loss_scale}: expected 0 (dynamic) or > 0")
    for key in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
        _require_positive(f"precision.{key}", getattr(p, key))


def _validate_zero(z: ZeroConfig) -> None:
    if z.stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero.stage = {z.stage}: expected 0, 1, 2 or 3")
    for key in (
        "reduce_bucket_size",
        "allgather_bucket_size",
        "zero_hpz_partition_size",
        "loco_reset_t",
        "paro_group_size",
    ):
        _require_positive(f"zero.{key}", getattr(z, key))
    for key in (
        "module_granularity_threshold",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_param_persistence_threshold",
    ):
        if getattr(z, key) < 0:
            raise ConfigError(f"zero.{key} = {getattr(z, key)}: expected a value >= 0")
    for key, allowed in (("fetch_groups", FETCH_GROUP_MODES), ("hierarchical", HIERARCHY_MODES)):
        if getattr(z, key) not in allowed:
            raise ConfigError(f"zero.{key} = {getattr(z, key)!r}: expected one of {', '.join(allowed)}")
    if str(z.paro_strategy).lower() != "auto":
        check_persistence(resolve_strategy(z.paro_strategy, z.stage), z.stage3_param_persistence_threshold)
    try:
        check_err_beta(z.loco_err_beta)
    except ConfigError as err:
        raise ConfigError(f"zero.loco_err_beta (zeropp_loco_param.err_beta): {err}") from None
    check_cpu_kernels(z.cpu_quant_kernels)
    for key in ("qwz_block_size", "qgz_block_size"):
        try:
            check_block_size(getattr(z, key))
        except ConfigError as err:
            raise ConfigError(f"zero.{key}: {err}") from None


def resolve_outer(cfg: Config, world_size: int, ranks_per_node: int | None) -> OuterOptions | None:
    """The `outer` section's checked options (None: two-level training off), with the rules that
    span sections: islands of whole nodes over this world (`ranks_per_node`: the launcher's,
    unless the config sets it), and the combinations not built yet. `zero.paro_strategy: auto`
    is allowed: the island's strategy is chosen once the ranks can probe their links
    (`planner.auto.auto_strategy` with the outer options)."""
    options = cfg.outer.resolve()
    if options is None:
        return None
    layers = cfg.model.num_layers // cfg.pp
    if options.fragments > layers:
        raise ConfigError(
            f"outer.fragments = {options.fragments}: a pipeline stage holds {layers} layer(s) here; "
            f"fragments are runs of parameter tensors, use at most one per layer ({layers})"
        )
    per_node = cfg.parallel.ranks_per_node or ranks_per_node or world_size
    try:
        island_layout(world_size, cfg.tp, cfg.pp, per_node, options.island_nodes)
    except TopologyError as err:
        raise ConfigError(f"outer.algorithm diloco on {world_size} ranks, {per_node} per node: {err}") from None
    return options
