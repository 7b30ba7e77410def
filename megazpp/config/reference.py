"""`pretrain_gpt.py --help` and `docs/flags.md`, both generated from the config schema.

Why generated: the flags are the dataclass fields (`megazpp.config.flag_table`), so a
hand-written reference would drift from them. This module holds one line of help per field
(a test requires a line for every field and none for a field that is gone) and renders the
same table twice: as console text and as Markdown. `python -m megazpp.config.reference`
rewrites docs/flags.md; a test checks the committed file is what it would write.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megazpp.config.aliases import MEGATRON_ALIASES, REFUSED_FLAGS
from megazpp.config.load import file_defaults
from megazpp.config.schema import FLAG_NAMES, SECTIONS, Config, flag_table

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "flags.md"

SECTION_HELP: dict[str, str] = {
    "model": "shape and behaviour of the GPT-2 / Llama model",
    "data": "indexed dataset, blend, split and tokenizer",
    "optimizer": "AdamW and gradient clipping",
    "training": "batch sizes, run length, learning-rate schedule, evaluation, numerics",
    "precision": "model dtype, gradient accumulation dtype, fp16 loss scaling",
    "checkpoint": "where checkpoints go and come from",
    "logging": "console and TensorBoard",
    "parallel": "tensor / pipeline parallel layout and process groups",
    "zero": "the data-parallel optimizer: ZeRO stage or PaRO strategy, ZeRO++, LoCo",
    "planner": "cluster facts for `zero.paro_strategy: auto` and `zero.hierarchical: auto`",
    "outer": "two-level training: ZeRO inside islands of nodes, DiLoCo outer steps across them (docs/arch/outer.md)",
}

HELP: dict[str, str] = {
    "model.arch": "llama (RoPE, RMSNorm, SwiGLU) or gpt2 (learned positions, LayerNorm, GELU)",
    "model.num_layers": "transformer layers",
    "model.hidden_size": "model width",
    "model.num_attention_heads": "attention heads",
    "model.num_query_groups": "key/value heads for grouped-query attention; none: one per head",
    "model.ffn_hidden_size": "MLP width; none: 4h for gpt2, ~8h/3 rounded to 64 for llama",
    "model.vocab_size": "embedding rows; unless set: the tokenizer's vocabulary, padded",
    "model.seq_length": "training sequence length (also gpt2's position table size)",
    "model.norm_eps": "epsilon of RMSNorm / LayerNorm",
    "model.rope_theta": "RoPE base frequency",
    "model.tie_embeddings": "share input embedding and output layer; none: gpt2 yes, llama no",
    "model.hidden_dropout": "dropout after attention and MLP",
    "model.attention_dropout": "dropout on attention probabilities",
    "model.num_experts": "experts per MoE layer (0: dense MLP)",
    "model.moe_top_k": "experts each token is routed to",
    "model.moe_ffn_hidden_size": "expert MLP width; none: ffn_hidden_size / moe_top_k",
    "model.moe_aux_loss_coeff": "weight of the MoE load-balancing loss",
    "model.activation_checkpointing": "recompute each layer's activations in backward",
    "model.lora_rank": (
        "LoRA adapter rank on the lora_targets linears (0: none); with adapters, only they train unless "
        "training.trainable adds more"
    ),
    "model.lora_alpha": "LoRA scale numerator: adapters add lora_alpha / lora_rank x B A",
    "model.lora_targets": (
        "linears that get adapters: qkv out gate_proj up_proj down_proj (llama), fc1 fc2 (gpt2); none: all"
    ),
    "model.init_std": "standard deviation of the weight init",
    "model.init_seed": "seed of the weight init (same model for every parallel layout)",
    "data.data_path": "indexed dataset prefix, or a blend: W1 PREFIX1 W2 PREFIX2 ...",
    "data.split": "train,valid,test weights of the documents",
    "data.tokenizer_model": "SentencePiece .model file",
    "data.make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this x TP",
    "data.allow_tokenizer_mismatch": (
        "train on data whose recorded tokenizer (PREFIX.tokenizer.json) is not --tokenizer-model"
    ),
    "optimizer.lr": "peak learning rate",
    "optimizer.min_lr": "learning rate at the end of the decay",
    "optimizer.weight_decay": "AdamW decoupled weight decay (not on norms and biases)",
    "optimizer.adam_beta1": "AdamW beta1",
    "optimizer.adam_beta2": "AdamW beta2",
    "optimizer.adam_eps": "AdamW epsilon",
    "optimizer.clip_grad": "clip the global gradient norm to this (0: off)",
    "training.micro_batch_size": "samples per rank per forward/backward",
    "training.global_batch_size": "samples per optimizer step; none: micro x dp",
    "training.gradient_accumulation_steps": "micro-batches per step (DeepSpeed style; sets the global batch)",
    "training.train_iters": "optimizer steps of the run",
    "training.lr_warmup_iters": "linear warmup steps (a config file's warmup is scaled to a shorter run)",
    "training.lr_warmup_fraction": "warmup as a fraction of the decay length (instead of lr_warmup_iters)",
    "training.lr_decay_iters": "decay length; none: train_iters",
    "training.lr_decay_style": "cosine, linear or constant",
    "training.eval_interval": "evaluate every N steps (and at the last)",
    "training.eval_iters": "validation batches per evaluation (0: none)",
    "training.seed": "data order and dropout",
    "training.max_bad_steps": "stop after N consecutive non-finite steps",
    "training.loss_spike_factor": "log a spike above this x the recent mean loss (0: off)",
    "training.loss_spike_window": "good steps in the recent mean",
    "training.trainable": (
        "what trains: name globs (*norm* *.bias layers.7.*) or last:N layers; empty: all (LoRA: adapters)"
    ),
    "training.compile": (
        "torch.compile each transformer layer (rotary in real arithmetic); the first steps compile; with "
        "parameters sharded (ZeRO-3, PaRO I/G) each layer is one fetch unit"
    ),
    "training.skip_memory_check": "start even when the estimated memory per rank exceeds the free memory",
    "precision.bf16": "bf16 model with fp32 master weights",
    "precision.fp16": "fp16 model with fp32 masters and a loss scaler",
    "precision.grad_accum_dtype": "dtype micro-batch gradients are summed in (fp32 or the model's)",
    "precision.loss_scale": "fp16 static loss scale (0: dynamic)",
    "precision.initial_loss_scale": "fp16 dynamic scale to start from",
    "precision.min_loss_scale": "fp16 dynamic scale floor",
    "precision.loss_scale_window": "good steps before the dynamic scale doubles",
    "precision.hysteresis": "overflows in a row before the dynamic scale halves",
    "checkpoint.save": "save directory (also resumed from: see the README's resume rule)",
    "checkpoint.load": "continue the run whose checkpoint is here, whatever its settings",
    "checkpoint.save_interval": "save every N steps (and at the last)",
    "checkpoint.exit_interval": "stop after step N, saving first",
    "checkpoint.exit_duration_in_mins": "stop (saving first) after the step that ends this many minutes after start",
    "checkpoint.load_fallback": "load the previous complete checkpoint if the newest is refused",
    "checkpoint.load_optional": "a --load holding no checkpoint starts from scratch instead of being refused",
    "checkpoint.overwrite_newer_checkpoints": (
        "allow a run starting below --save's newest checkpoint to move latest back"
    ),
    "checkpoint.save_adapters_only": (
        "save only what trains (LoRA adapters, training.trainable) and its state; resuming reloads the "
        "recorded frozen base"
    ),
    "logging.tensorboard_dir": "TensorBoard event directory (none: console only)",
    "logging.log_interval": "console line and TensorBoard points every N steps",
    "parallel.tensor_model_parallel_size": "tensor-parallel ranks",
    "parallel.pipeline_model_parallel_size": "pipeline stages",
    "parallel.sequence_parallel": "split norms and dropout over the tensor-parallel ranks",
    "parallel.ranks_per_node": "ranks per (virtual) node; none: the launcher's",
    "parallel.distributed_timeout_minutes": "a collective waiting longer fails",
    "parallel.distributed_backend": "auto (nccl on GPUs, gloo on CPUs), nccl, or gloo (also on CUDA: several "
    "ranks may then share one GPU, round robin)",
    "zero.stage": "ZeRO stage 0-3 (aliases of PaRO NNN, NNG, NGG, GGG)",
    "zero.paro_strategy": "PaRO triple (e.g. NIG, III) or auto (the planner picks)",
    "zero.paro_group_size": "ranks of a PaRO I group; none: the node",
    "zero.reduce_bucket_size": "elements per gradient bucket (also bounds a fetch group)",
    "zero.allgather_bucket_size": "elements per parameter fetch group at most",
    "zero.contiguous_gradients": "always on (flat buckets)",
    "zero.overlap_comm": "prefetch groups and overlap reductions with backward; false: wait each at once",
    "zero.reduce_scatter": "always on (gradients reduced to their shard level)",
    "zero.zero_quantized_weights": "qwZ: int8 parameter all-gather",
    "zero.zero_hpz_partition_size": "hpZ: ranks of the node-local secondary parameter copy",
    "zero.zero_quantized_gradients": "qgZ: int4 gradient all-to-all",
    "zero.loco": "LoCo error feedback for qgZ",
    "zero.loco_err_beta": "LoCo error decay",
    "zero.loco_reset_t": "LoCo buffer reset period (steps)",
    "zero.module_granularity_threshold": "fetch modules finer than this whole (coalesced)",
    "zero.fetch_groups": "layer (one fetch group per transformer layer) or size (execution-order, bounded in elements)",
    "zero.stage3_prefetch_bucket_size": "elements of fetch groups gathered ahead of use",
    "zero.stage3_max_live_parameters": "elements kept gathered from forward to backward (0: re-gather in backward)",
    "zero.stage3_max_reuse_distance": "keep a group for backward only if reused within this many elements",
    "zero.stage3_param_persistence_threshold": "parameters of fewer elements stay whole on every rank, "
    "refreshed after each step in one collective (0: none)",
    "zero.hierarchical": "two-stage (node, then across nodes) collectives: auto (the planner prices them), "
    "always or never",
    "zero.cpu_quant_kernels": "reference or compiled (TorchInductor) quantizers on CPU",
    "zero.qwz_block_size": "values per int8 scale in qwZ",
    "zero.qgz_block_size": "values per int4 scale in qgZ",
    "planner.probe": "measure links and compute at start-up",
    "planner.accelerator_memory_gib": "memory per accelerator; none: the device's",
    "planner.achievable_tflops": "sustained TFLOP/s per accelerator",
    "planner.intra_node_gbs": "GB/s per accelerator inside a node",
    "planner.inter_node_gbit": "Gbit/s per node between nodes",
    "planner.intra_node_latency_us": "latency of an intra-node collective step",
    "planner.inter_node_latency_us": "latency of an inter-node collective step",
    "planner.memory_bandwidth_gbs": "accelerator memory bandwidth",
    "planner.usable_memory_fraction": "share of memory the plan may fill",
    "outer.algorithm": "none (synchronous over all ranks) or diloco (islands + outer optimizer)",
    "outer.sync_every": "H: inner steps between outer syncs",
    "outer.lr": "outer learning rate (Nesterov SGD on the averaged pseudo-gradient)",
    "outer.momentum": "outer Nesterov momentum",
    "outer.fragments": "streaming: fragments (runs of parameter tensors) synced at staggered steps, at most H",
    "outer.overlap_steps": "streaming: inner steps an outer exchange runs before it is applied (tau, below H)",
    "outer.merge_alpha": "with overlap: weight of the island's own parameters when an exchange is applied",
    "outer.quantize": "outer-gradient wire format: none (fp32), bf16, int4 (blocks of 256, error feedback)",
    "outer.error_feedback": "int4 wire: add what the wire dropped back at the next sync (false: the ablation)",
    "outer.island_nodes": "nodes per island",
}

FILE_FLAGS = (
    ("--config FILE", "YAML config (sections as below); flags override it"),
    ("--deepspeed_config FILE", "DeepSpeed JSON (zero_optimization, fp16, bf16, optimizer, ...)"),
)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return "{" + ",".join(str(c) for c in typing.get_args(hint)) + "}"
    if origin is list:
        return typing.get_args(hint)[0].__name__ + " ..."
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return _type_name(args[0])
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field[object]) -> str:
    """A field's declared default (not a derived value: ffn_hidden_size's none stays none)."""
    if f.default is not dataclasses.MISSING:
        return _shown(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _shown(f.default_factory())
    return "required"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "[]"
    return str(value)


def reference_rows(
    shown: Config | None = None,
    origins: dict[str, str] | None = None,
) -> dict[str, list[tuple[str, str, str, str]]]:
    """section -> [(flag, type, default, help)] in schema order. The default is the built-in
    value, or `shown`'s where `origins` says a file set it (then with the built-in beside it)."""
    table = flag_table()
    by_field = {v: k for k, v in table.items()}
    shown = shown or Config()
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = by_field[(section, f.name)]
            kind = "" if hints[f.name] is bool else _type_name(hints[f.name])
            flags = f"{flag} / --no-{flag[2:]}" if hints[f.name] is bool else flag
            default = _default(f)
            source = (origins or {}).get(f"{section}.{f.name}")
            if source is not None:
                default = (
                    f"{_shown(getattr(getattr(shown, section), f.name))} from the "
                    f"{source.split(' ', 1)[0]} file; built-in {default}"
                )
            rows.setdefault(section, []).append((flags, kind, default, HELP.get(f"{section}.{f.name}", "")))
    return rows


def _alias_lines() -> list[tuple[str, str]]:
    lines = []
    for alias, target in MEGATRON_ALIASES.items():
        lines.append((alias, "= " + (target if isinstance(target, str) else " ".join(target))))
    for flag, why in REFUSED_FLAGS.items():
        lines.append((flag, "refused: " + why))
    return lines


def render_help(argv: Sequence[str] = ()) -> str:
    """The console text of `pretrain_gpt.py --help`: with `--config` / `--deepspeed_config` in
    `argv` (run.sh passes its CONFIG), the defaults those files set, as the command would run."""
    shown, origins = file_defaults(argv)
    files = list(dict.fromkeys(source for source in origins.values()))
    out = [
        "usage: pretrain_gpt.py [--config FILE] [--deepspeed_config FILE] [--FLAG VALUE ...]",
        "",
        "Pretrain a GPT-2 or Llama model. Precedence: defaults < --config < --deepspeed_config < flags.",
        "Every config key is a flag: section.some_key is "
        "--some-key (except " + ", ".join(f"{k} {v}" for k, v in FLAG_NAMES.items()) + ").",
        "Defaults shown: "
        + (
            " over ".join(reversed(files)) + " over the built-in values"
            if files
            else "the built-in values (no --config given)"
        )
        + ".",
        "",
        "files:",
    ]
    out += [f"  {flag:<34} {text}" for flag, text in FILE_FLAGS]
    for section, rows in reference_rows(shown, origins).items():
        out += ["", f"{section}: {SECTION_HELP.get(section, '')}"]
        for flag, kind, default, text in rows:
            left = f"{flag} {kind}".rstrip()
            out.append(f"  {left:<34} {text} (default: {default})")
    out += ["", "Megatron-LM spellings:"]
    out += [f"  {flag:<34} {text}" for flag, text in _alias_lines()]
    return "\n".join(out) + "\n"


def render_markdown() -> str:
    """docs/flags.md."""
    out = [
        "# Flag reference",
        "",
        "Generated from the config schema by `python -m megazpp.config.reference` (do not "
        "edit by hand; a test checks it is current). `pretrain_gpt.py --help` prints the "
        "same. Precedence: defaults < `--config` YAML < `--deepspeed_config` JSON < flags. "
        "A YAML key is the flag's field name under its section (`--micro-batch-size` is "
        "`training: {micro_batch_size: ...}`).",
        "",
        "| file flag | meaning |",
        "|---|---|",
    ]
    out += [f"| `{flag}` | {text} |" for flag, text in FILE_FLAGS]
    for section, rows in reference_rows().items():
        out += [
            "",
            f"## {section}",
            "",
            SECTION_HELP.get(section, "") + ".",
            "",
            "| flag | type | default | meaning |",
            "|---|---|---|---|",
        ]
        out += [f"| `{flag}` | {kind.replace('|', '/')} | {default} | {text} |" for flag, kind, default, text in rows]
    out += ["", "## Megatron-LM spellings", "", "| Megatron flag | megazpp |", "|---|---|"]
    out += [f"| `{flag}` | {text} |" for flag, text in _alias_lines()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    DOC_PATH.write_text(render_markdown())
    print(f"wrote {DOC_PATH}", file=sys.stderr)
