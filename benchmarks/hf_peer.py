"""Hugging Face's `LlamaForCausalLM` as the peer of a megazpp Llama in the model benchmark.

Why: a throughput figure means more beside the reference implementation most users know, run
on the same machine, shape, dtype and batch, and the peer doubles as a check of the step
itself: built from the same weights (`megazpp.interop.hf_llama`'s conversion), its loss on the
benchmark batch before any update must equal megazpp's to within rounding.
"""

from __future__ import annotations

import importlib.util
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from megazpp.interop.hf_llama import hf_config_from_model, megazpp_to_hf
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel


def peer_available(cfg: ModelConfig) -> bool:
    """Whether a peer can be built: a Llama and transformers importable."""
    return cfg.is_llama and importlib.util.find_spec("transformers") is not None


def hf_peer(model: GPTModel, cfg: ModelConfig) -> nn.Module:
    """A LlamaForCausalLM of `model`'s shape holding its weights, in its dtype, on its device,
    in training mode (gradient checkpointing on when `cfg.activation_checkpointing`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    weight = next(model.parameters())
    peer = LlamaForCausalLM(LlamaConfig(**hf_config_from_model(cfg, weight.dtype)))
    missing, unexpected = peer.load_state_dict(megazpp_to_hf(model.state_dict(), cfg), strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"HF peer: weights missing {missing}, unexpected {unexpected}")
    # transformers types `to` through a decorator mypy cannot call
    peer = peer.to(device=weight.device, dtype=weight.dtype).train()  # type: ignore[call-arg]
    if cfg.activation_checkpointing:
        peer.gradient_checkpointing_enable()
    return cast(nn.Module, peer)  # transformers' model, typed Any through that decorator


def peer_loss(peer: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy of the peer's logits, as megazpp's per-token loss averaged."""
    logits = peer(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
