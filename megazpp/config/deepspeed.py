"""Read a DeepSpeed JSON config and translate it into megazpp config sections.

Why: users arrive with DeepSpeed JSON files; accepting them as-is (rather than asking for a
rewrite) is what makes comparing the two frameworks cheap. The translation is explicit and
total: every key DeepSpeed documents is either mapped to a typed field, refused because its
feature does not exist here, or (if it is not a DeepSpeed key at all) refused with the closest
valid name. Nothing is silently dropped.

The result is `{section: {field: value}}`; `megazpp.config` type-checks it like YAML.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megazpp.config.values import suggest
from megazpp.errors import ConfigError
from megazpp.unique_keys import DuplicateKeyError, load_json

Sections = dict[str, dict[str, Any]]
Put = Callable[[str, str, Any, str], None]  # section, field, value, the DeepSpeed key's path

# zero_optimization keys that map one to one onto `ZeroOptions` fields (the `zero` section) of the same meaning.
_ZERO_DIRECT = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm",
    "reduce_scatter": "reduce_scatter",
    "zero_quantized_weights": "zero_quantized_weights",
    "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_quantized_gradients": "zero_quantized_gradients",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "stage3_max_reuse_distance": "stage3_max_reuse_distance",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    # PaRO's proposed key (DeepSpeed issue 5607): any of the 14 strategies, or "auto"
    "paro_strategy": "paro_strategy",
    # the name module_granularity_threshold had in its DeepSpeed PR (6649) before the rename
    "stage3_coalesced_fetch_threshold": "module_granularity_threshold",
}

# Valid DeepSpeed keys whose feature megazpp does not have. Each is accepted only at a value
# that asks for nothing beyond what megazpp does anyway (the mapped value, or `_OFF`: false /
# 0 / null / {} / {"enabled": false}); any other value is refused as not implemented.
_OFF = object()
_ZERO_UNSUPPORTED: dict[str, Any] = {
    "allgather_partitions": True,
    "ignore_unused_parameters": True,
    **{
        key: _OFF
        for key in (
            "offload_param",
            "offload_optimizer",
            "cpu_offload",
            "cpu_offload_params",
            "cpu_offload_use_pin_memory",
            "sub_group_size",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "round_robin_gradients",
            "elastic_checkpoint",
            "zero_quantized_nontrainable_weights",
            "memory_efficient_linear",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "legacy_stage1",
            "use_multi_rank_bucket_allreduce",
            "load_from_fp32_weights",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "zero_allow_untested_optimizer",
            "stage3_use_all_reduce_for_fetch_params",
        )
    },
}
_TOP_UNSUPPORTED: dict[str, Any] = {
    key: _OFF
    for key in (
        "scheduler",
        "wall_clock_breakdown",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "sparse_gradients",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "activation_checkpointing",
        "flops_profiler",
        "comms_logger",
        "wandb",
        "csv_monitor",
        "amp",
        "compression_training",
        "autotuning",
        "elasticity",
        "checkpoint",
        "data_efficiency",
        "curriculum_learning",
        "aio",
        "dump_state",
        "memory_breakdown",
        "sparse_attention",
        "pipeline",
        "compile",
        "fp8",
        "torch_autocast",
        "nebula",
        "weight_quantization",
        "hybrid_engine",
    )
}
# The top-level keys this module reads (each one's handler is in `map_deepspeed_config`).
DEEPSPEED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "optimizer",
    "fp16",
    "bf16",
    "bfloat16",
    "data_types",
    "tensorboard",
    "zero_optimization",
)
_FP16_KEYS = {
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
}
_OPTIMIZER_TYPES = {"adam", "adamw", "fusedadam"}
_OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad"}


def is_deepspeed_key(key: object) -> bool:
    """Whether `key` is a top-level key of a DeepSpeed config (read here or refused here)."""
    return key in DEEPSPEED_KEYS or key in _TOP_UNSUPPORTED


def read_deepspeed_config(path: str, names: dict[str, str] | None = None) -> Sections:
    """Parse the JSON file at `path` and map it; every refusal names the file and the key.
    `names` receives, per `section.field` set, the DeepSpeed key that set it (for the type
    checks' messages, which then name the key the user wrote)."""
    try:
        raw = load_json(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"DeepSpeed config {path}: cannot be read ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, DuplicateKeyError) as exc:
        raise ConfigError(f"DeepSpeed config {path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"DeepSpeed config {path}: expected a JSON object at the top level")
    return map_deepspeed_config(raw, path, names)


def map_deepspeed_config(raw: dict[str, Any], source: str, names: dict[str, str] | None = None) -> Sections:
    """`"auto"` (as Hugging Face's integration writes it: "fill in from the trainer's
    arguments") sets nothing, so the field keeps its value from --config, the flags or the
    default, which is where this project's trainer arguments are; `zero_optimization.paro_strategy`
    is the exception, whose "auto" is the planner's choice."""
    out: Sections = {}

    def put(section: str, key: str, value: Any, where: str) -> None:
        if value == "auto" and (section, key) != ("zero", "paro_strategy"):
            return
        out.setdefault(section, {})[key] = value
        if names is not None:
            names[f"{section}.{key}"] = where.removeprefix(f"DeepSpeed config {source}: ")

    handlers: dict[str, Callable[[Any, str], None]] = {
        "train_batch_size": lambda v, w: put("training", "global_batch_size", v, w),
        "train_micro_batch_size_per_gpu": lambda v, w: put("training", "micro_batch_size", v, w),
        "gradient_accumulation_steps": lambda v, w: put("training", "gradient_accumulation_steps", v, w),
        "gradient_clipping": lambda v, w: put("optimizer", "clip_grad", v, w),
        "steps_per_print": lambda v, w: put("logging", "log_interval", v, w),
        "optimizer": lambda v, w: _map_optimizer(v, w, put),
        "fp16": lambda v, w: _map_fp16(v, w, put),
        "bf16": lambda v, w: _map_bf16(v, w, put),
        "bfloat16": lambda v, w: _map_bf16(v, w, put),
        "data_types": lambda v, w: _map_data_types(v, w, put),
        "tensorboard": lambda v, w: _map_tensorboard(v, w, put),
        "zero_optimization": lambda v, w: _map_zero(v, w, put),
    }
    assert set(handlers) == set(DEEPSPEED_KEYS)
    for key, value in raw.items():
        where = f"DeepSpeed config {source}: {key}"
        if key in handlers:
            handlers[key](value, where)
        elif key in _TOP_UNSUPPORTED:
            _refuse_unless_accepted(value, _TOP_UNSUPPORTED[key], where)
        else:
            raise ConfigError(
                f"DeepSpeed config {source}: unknown key {key!r}"
                f"{suggest(key, list(handlers) + sorted(_TOP_UNSUPPORTED))}"
            )
    return out


def _is_off(value: Any) -> bool:
    if isinstance(value, dict):
        return not value or value.get("enabled") is False
    return value is None or value is False or (not isinstance(value, bool) and value == 0)


def _refuse_unless_accepted(value: Any, accepted: Any, where: str) -> None:
    if not (_is_off(value) if accepted is _OFF else value == accepted):
        raise ConfigError(f"{where} = {value!r}: this DeepSpeed feature is not implemented yet in megazpp")


def _require_mapping(value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {value!r}")
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r}{suggest(key, sorted(allowed))}")
    return value


def _map_optimizer(value: Any, where: str, put: Put) -> None:
    block = _require_mapping(value, where, {"type", "params"})
    kind = str(block.get("type", "AdamW"))
    if kind.lower() not in _OPTIMIZER_TYPES:
        raise ConfigError(
            f"{where}.type = {kind!r}: only AdamW is read from a DeepSpeed config "
            f"(accepted: Adam, AdamW, FusedAdam with decoupled weight decay; SGD is --optimizer sgd)"
        )
    params = _require_mapping(block.get("params", {}), f"{where}.params", _OPTIMIZER_PARAMS)
    for key in ("lr", "eps", "weight_decay"):
        if key in params:
            put("optimizer", {"eps": "adam_eps"}.get(key, key), params[key], f"{where}.params.{key}")
    if "betas" in params and params["betas"] != "auto":
        betas = params["betas"]
        if not isinstance(betas, list) or len(betas) != 2:
            raise ConfigError(f"{where}.params.betas = {betas!r}: expected [beta1, beta2]")
        put("optimizer", "adam_beta1", betas[0], f"{where}.params.betas[0]")
        put("optimizer", "adam_beta2", betas[1], f"{where}.params.betas[1]")
    if params.get("adam_w_mode", True) is not True:
        raise ConfigError(
            f"{where}.params.adam_w_mode = false: L2-coupled Adam is not implemented yet (only decoupled AdamW)"
        )
    if params.get("amsgrad", False) is not False:
        raise ConfigError(f"{where}.params.amsgrad: AMSGrad is not implemented yet")
    if params.get("bias_correction", True) is not True:
        raise ConfigError(f"{where}.params.bias_correction = false: not implemented yet")


def _map_fp16(value: Any, where: str, put: Put) -> None:
    block = _require_mapping(value, where, _FP16_KEYS)
    if not block.get("enabled", False):
        return
    put("precision", "fp16", block["enabled"], f"{where}.enabled")  # "auto": the flags' choice
    if "loss_scale" in block:
        put("precision", "loss_scale", block["loss_scale"], f"{where}.loss_scale")
    if block.get("initial_scale_power", "auto") != "auto":
        power = block["initial_scale_power"]
        if not isinstance(power, int) or isinstance(power, bool) or not 0 <= power <= 64:
            raise ConfigError(f"{where}.initial_scale_power = {power!r}: expected an integer in [0, 64]")
        put("precision", "initial_loss_scale", float(2**power), f"{where}.initial_scale_power")
    for ds_key, key in (
        ("loss_scale_window", "loss_scale_window"),
        ("hysteresis", "hysteresis"),
        ("min_loss_scale", "min_loss_scale"),
    ):
        if ds_key in block:
            put("precision", key, block[ds_key], f"{where}.{ds_key}")
    for key in ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"):
        if block.get(key, False):
            raise ConfigError(f"{where}.{key} = true: not implemented yet in megazpp")


def _map_bf16(value: Any, where: str, put: Put) -> None:
    block = _require_mapping(value, where, {"enabled", "immediate_grad_update", "check_grad_overflow"})
    for key in ("immediate_grad_update", "check_grad_overflow"):
        if block.get(key, False):
            raise ConfigError(f"{where}.{key} = true: not implemented yet in megazpp")
    if block.get("enabled", False):
        put("precision", "bf16", block["enabled"], f"{where}.enabled")  # "auto": the flags' choice


_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}


def _map_data_types(value: Any, where: str, put: Put) -> None:
    block = _require_mapping(value, where, {"grad_accum_dtype"})
    if block.get("grad_accum_dtype") in (None, "auto"):
        return
    name = str(block["grad_accum_dtype"]).lower()
    if name not in _DTYPE_NAMES:
        raise ConfigError(f"{where}.grad_accum_dtype = {block['grad_accum_dtype']!r}: expected one of fp32, bf16, fp16")
    put("precision", "grad_accum_dtype", _DTYPE_NAMES[name], f"{where}.grad_accum_dtype")


def _map_tensorboard(value: Any, where: str, put: Put) -> None:
    block = _require_mapping(value, where, {"enabled", "output_path", "job_name"})
    if block.get("enabled", False) not in (False, "auto"):  # "auto": --tensorboard-dir decides
        path = str(block.get("output_path") or "runs")
        job = block.get("job_name")
        put("logging", "tensorboard_dir", str(Path(path) / job) if job else path, f"{where}.output_path")


def _map_zero(value: Any, where: str, put: Put) -> None:
    allowed = set(_ZERO_DIRECT) | set(_ZERO_UNSUPPORTED) | {"zeropp_loco_param"}
    block = _require_mapping(value, where, allowed)
    for key, item in block.items():
        if key in _ZERO_DIRECT:
            put("zero", _ZERO_DIRECT[key], item, f"{where}.{key}")
        elif key == "zeropp_loco_param":
            if item is None:
                continue
            loco = _require_mapping(item, f"{where}.zeropp_loco_param", {"err_beta", "reset_T"})
            put("zero", "loco", True, f"{where}.zeropp_loco_param")
            if "err_beta" in loco:
                put("zero", "loco_err_beta", loco["err_beta"], f"{where}.zeropp_loco_param.err_beta")
            if "reset_T" in loco:
                put("zero", "loco_reset_t", loco["reset_T"], f"{where}.zeropp_loco_param.reset_T")
        else:
            _refuse_unless_accepted(item, _ZERO_UNSUPPORTED[key], f"{where}.{key}")
