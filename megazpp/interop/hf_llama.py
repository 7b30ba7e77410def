"""Hugging Face Llama <-> megazpp: the config fields, parameter names and tensor layouts.

What differs between the two, and how it is bridged:

- q/k rows (RoPE layout). megazpp rotates adjacent pairs (2i, 2i+1) of each head (Meta's
  original layout, see megazpp/model/rotary.py); Hugging Face's Llama pairs i with
  i + head_dim/2 ("rotate half") and stores q_proj/k_proj rows permuted so that its rotation
  computes the same function as Meta's. Per head, HF row i (i < head_dim/2) holds megazpp row
  2i and HF row i + head_dim/2 holds megazpp row 2i + 1; `rotate_half_to_pairs` and
  `pairs_to_rotate_half` apply that permutation and its inverse. v and o are not rotated.
- q, k, v are one fused megazpp matrix `qkv`, its rows ordered per query group
  [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...] (so a TP shard
  holds whole groups). HF's grouped-query attention uses key/value head h // (heads / groups)
  for query head h, which is exactly megazpp's grouping, so query heads stay in order.
- Tied embeddings: megazpp's full weights hold only the embedding; HF's files usually omit
  lm_head.weight then (when present it must equal the embedding).

A config field the converter cannot carry over faithfully (RoPE scaling, biases, another
activation, a head_dim that is not hidden/heads, ...) raises ConfigError naming it: a model
that silently computes something else is worse than no model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megazpp.errors import CheckpointError, ConfigError, MegazppError, required
from megazpp.model.config import ModelConfig
from megazpp.unique_keys import JSONObject

# Fields that describe the file or generation defaults, not the function the weights compute.
_IGNORED_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tokenizer_class",
        "use_cache",
        "initializer_range",
        "pretraining_tp",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
_MAPPED_FIELDS = frozenset(
    {
        "model_type",
        "max_position_embeddings",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "attention_dropout",
    }
)
_DEFAULT_ROPE_THETA = 10000.0
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
# Non-parameter tensors some older HF checkpoints carry; they are functions of rope_theta.
_DERIVED_HF_TENSOR_SUFFIX = ".self_attn.rotary_emb.inv_freq"


def _require(hf: JSONObject, key: str, where: str) -> Any:
    if key not in hf:
        raise ConfigError(f"{where}: field {key!r} is missing (needed to build the model)")
    return hf[key]


def _rope_theta(hf: JSONObject, where: str) -> float:
    """rope_theta from the legacy top-level field or transformers 5's `rope_parameters`;
    any RoPE variant other than the default (llama3, linear, dynamic, yarn...) is refused."""
    scaling = hf.get("rope_scaling")
    if scaling is not None and (
        not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "default"
    ):
        raise ConfigError(f"{where}: rope_scaling = {scaling!r} is not supported (megazpp implements plain RoPE only)")
    theta = hf.get("rope_theta")
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: rope_parameters = {params!r}: expected an object")
        extra = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
        if params.get("rope_type", "default") != "default" or extra:
            raise ConfigError(
                f"{where}: rope_parameters = {params!r} is not supported (megazpp "
                "implements plain RoPE only: rope_type 'default', rope_theta)"
            )
        nested = params.get("rope_theta")
        if theta is not None and nested is not None and float(theta) != float(nested):
            raise ConfigError(f"{where}: rope_theta = {theta!r} contradicts rope_parameters.rope_theta = {nested!r}")
        theta = nested if nested is not None else theta
    return float(_DEFAULT_ROPE_THETA if theta is None else theta)


def model_config_from_hf(hf: JSONObject, *, seq_length: int | None = None, where: str = "config.json") -> ModelConfig:
    """The megazpp ModelConfig computing the same function as HF Llama config `hf`.

    `seq_length` defaults to the checkpoint's max_position_embeddings (RoPE has no table, so
    it only bounds the sequences megazpp will be asked to train on). A field of the wrong
    JSON type (a list where a number belongs) is a ConfigError too, not a TypeError.
    """
    try:
        return _model_config_from_hf(hf, seq_length, where)
    except MegazppError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{where}: a field has the wrong type or value ({exc})") from exc


def _model_config_from_hf(hf: JSONObject, seq_length: int | None, where: str) -> ModelConfig:
    unknown = sorted(set(hf) - _IGNORED_FIELDS - _MAPPED_FIELDS)
    if unknown:
        raise ConfigError(
            f"{where}: field {unknown[0]!r} = {hf[unknown[0]]!r} is not understood "
            f"by the Llama converter (unknown fields: {unknown})"
        )
    model_type = _require(hf, "model_type", where)
    if model_type != "llama":
        raise ConfigError(f"{where}: model_type = {model_type!r} is not supported (expected 'llama')")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act = {act!r} is not supported (megazpp's Llama MLP is SwiGLU: 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise ConfigError(f"{where}: {key} = {hf[key]!r} is not supported (megazpp's Llama has no biases)")
    hidden = _require(hf, "hidden_size", where)
    heads = _require(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise ConfigError(
            f"{where}: head_dim = {head_dim} is not hidden_size / "
            f"num_attention_heads = {hidden} / {heads} (megazpp derives the head "
            "size from them)"
        )
    max_positions = hf.get("max_position_embeddings")
    length = seq_length if seq_length is not None else max_positions
    if length is None:
        raise ConfigError(f"{where}: max_position_embeddings is missing; give the sequence length explicitly")
    layers, ffn = _require(hf, "num_hidden_layers", where), _require(hf, "intermediate_size", where)
    vocab, theta = _require(hf, "vocab_size", where), _rope_theta(hf, where)
    try:  # the model config checks itself when built; its refusal names the file
        return ModelConfig(
            arch="llama",
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            ffn_hidden_size=ffn,
            vocab_size=vocab,
            seq_length=length,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            rope_theta=theta,
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def check_exportable(cfg: ModelConfig) -> None:
    if not cfg.is_llama:
        raise ConfigError(f"model.arch = {cfg.arch!r}: only 'llama' models export to Hugging Face Llama")
    if cfg.num_experts:
        raise ConfigError(f"model.num_experts = {cfg.num_experts}: MoE models have no Hugging Face Llama equivalent")


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype) -> JSONObject:
    """config.json for LlamaForCausalLM. rope_theta is written both top-level (transformers 4)
    and as rope_parameters (transformers 5), so either version reads the same model."""
    check_exportable(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def rotate_half_to_pairs(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection from HF's rotate-half order to megazpp's adjacent pairs."""
    return w.reshape(num_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def pairs_to_rotate_half(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of `rotate_half_to_pairs`."""
    return w.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q_proj, k_proj, v_proj weights -> megazpp's per-group qkv weight."""
    groups, d = required(cfg.num_query_groups, "model.num_query_groups"), cfg.head_dim
    q = rotate_half_to_pairs(q, cfg.num_attention_heads, d).reshape(groups, -1, cfg.hidden_size)
    k = rotate_half_to_pairs(k, groups, d).reshape(groups, d, cfg.hidden_size)
    v = v.reshape(groups, d, cfg.hidden_size)
    return torch.cat([q, k, v], dim=1).reshape(-1, cfg.hidden_size)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    groups, d = required(cfg.num_query_groups, "model.num_query_groups"), cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, cfg.hidden_size).split([per_group * d, d, d], dim=1)
    q = pairs_to_rotate_half(q.reshape(-1, cfg.hidden_size), cfg.num_attention_heads, d)
    k = pairs_to_rotate_half(k.reshape(-1, cfg.hidden_size), groups, d)
    return q.contiguous(), k.contiguous(), v.reshape(-1, cfg.hidden_size).contiguous()


# megazpp layer-local name -> HF layer-local name, for the tensors that map one to one.
_LAYER_RENAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attention.out.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_QKV_HF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def _top_level_renames(cfg: ModelConfig) -> dict[str, str]:
    names = {EMBEDDING: "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names[OUTPUT] = "lm_head.weight"
    return names


def hf_to_megazpp(
    hf: Mapping[str, torch.Tensor], cfg: ModelConfig, where: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM weights (any mapping name -> tensor, read lazily) -> megazpp's
    full weights. Every HF tensor must be used: a leftover means a layout this converter does
    not understand, and dropping it would change the model."""
    expected: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        expected.add(name)
        return hf[name]

    out = {ours: take(theirs) for ours, theirs in _top_level_renames(cfg).items()}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in _LAYER_RENAMES.items():
            out[f"layers.{i}.{ours}"] = take(prefix + theirs)
        q, k, v = (take(prefix + n) for n in _QKV_HF)
        out[f"layers.{i}.attention.qkv.weight"] = fuse_qkv(q, k, v, cfg)
    if cfg.tie_embeddings and "lm_head.weight" in hf:
        if not torch.equal(take("lm_head.weight"), out[EMBEDDING]):
            raise CheckpointError(
                f"{where}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
    leftover = sorted(n for n in hf if n not in expected and not n.endswith(_DERIVED_HF_TENSOR_SUFFIX))
    if leftover:
        raise CheckpointError(
            f"{where}: tensor {leftover[0]!r} is not part of a Llama model "
            f"with this config.json ({len(leftover)} unexpected tensors)"
        )
    return out


def megazpp_to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megazpp's full weights -> HF LlamaForCausalLM state dict (tied: no lm_head.weight)."""
    check_exportable(cfg)
    out = {theirs: full[ours] for ours, theirs in _top_level_renames(cfg).items()}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for ours, theirs in _LAYER_RENAMES.items():
            out[prefix + theirs] = full[f"layers.{i}.{ours}"]
        for name, tensor in zip(_QKV_HF, split_qkv(full[f"layers.{i}.attention.qkv.weight"], cfg)):
            out[prefix + name] = tensor
    return out
