"""Parameter counts and training FLOPs per token, for MFU.

FLOPs follow the PaLM / Megatron model-FLOPs convention: a token costs 2 FLOPs per weight it
multiplies through in the forward pass and twice that again in the backward (6 per weight),
plus attention's two sequence-length matmuls (QK^T and softmax(..)V), 2 * 2 * s * heads * d
forward per layer, so 12 * s * heads * d per layer for training. The causal mask is not
discounted (as in PaLM), recomputation under activation checkpointing is not counted (it is
hardware work, not model work). Weights counted are those of the matmuls a token passes through:
q/k/v/out, the MLP (only its top-k experts under MoE, plus the router) and the output layer
(even when tied: the matmul still runs); embedding lookups, norms and biases are not matmuls.
"""

from __future__ import annotations

from megazpp.errors import required
from megazpp.model.config import ModelConfig


def _attention_weights(cfg: ModelConfig) -> int:
    qkv = (cfg.num_attention_heads + 2 * required(cfg.num_query_groups, "model.num_query_groups")) * cfg.head_dim
    return cfg.hidden_size * qkv + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size


def _attention_biases(cfg: ModelConfig) -> int:
    if not cfg.use_bias:
        return 0
    return (
        cfg.num_attention_heads + 2 * required(cfg.num_query_groups, "model.num_query_groups")
    ) * cfg.head_dim + cfg.hidden_size


def _expert_weights(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * required(cfg.moe_ffn_hidden_size, "model.moe_ffn_hidden_size")


def _dense_mlp_weights(cfg: ModelConfig) -> int:
    matrices = 3 if cfg.is_llama else 2
    return matrices * cfg.hidden_size * required(cfg.ffn_hidden_size, "model.ffn_hidden_size")


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.hidden_size * (1 if cfg.is_llama else 2)


def layer_parameter_count(cfg: ModelConfig) -> int:
    """Parameters of one transformer layer (all experts included)."""
    if cfg.num_experts:
        mlp = cfg.num_experts * (_expert_weights(cfg) + cfg.hidden_size)  # + router row each
    else:
        mlp = _dense_mlp_weights(cfg)
        if cfg.use_bias:
            mlp += required(cfg.ffn_hidden_size, "model.ffn_hidden_size") + cfg.hidden_size
    return 2 * _norm_params(cfg) + _attention_weights(cfg) + _attention_biases(cfg) + mlp


def parameter_text(count: int) -> str:
    """A parameter count as people say it: "3.41 M", "6.74 B" (the tiny models have millions,
    which "0.00 B" hid)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return str(count)


def parameter_count(cfg: ModelConfig) -> int:
    """Distinct parameters of the whole single-process model (a tied head counted once)."""
    embedding = cfg.vocab_size * cfg.hidden_size
    if not cfg.is_llama:
        embedding += cfg.seq_length * cfg.hidden_size
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return embedding + cfg.num_layers * layer_parameter_count(cfg) + _norm_params(cfg) + head


def matmul_weights_per_token(cfg: ModelConfig) -> int:
    """Weights one token multiplies through in a forward pass (the N of 6N)."""
    if cfg.num_experts:
        mlp = cfg.moe_top_k * _expert_weights(cfg) + cfg.num_experts * cfg.hidden_size
    else:
        mlp = _dense_mlp_weights(cfg)
    return cfg.num_layers * (_attention_weights(cfg) + mlp) + cfg.vocab_size * cfg.hidden_size


def training_flops_per_token(cfg: ModelConfig, seq_length: int | None = None) -> int:
    """Model FLOPs of forward + backward for one token at sequence length `seq_length`
    (default cfg.seq_length): 6 N + 12 * layers * s * heads * head_dim."""
    s = cfg.seq_length if seq_length is None else seq_length
    attention = 12 * cfg.num_layers * s * cfg.num_attention_heads * cfg.head_dim
    return 6 * matmul_weights_per_token(cfg) + attention
