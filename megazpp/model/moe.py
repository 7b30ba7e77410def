"""Mixture-of-experts feed-forward block: a top-k softmax router over many small SwiGLU experts.

Fine-grained MoE models (Qwen2-MoE: dozens of experts, three small linears each) stress the
ZeRO engine's per-module machinery, so every expert is its own module. Every expert runs on
every step, on an empty batch when no token picked it: its parameters then get a zero gradient
rather than none, so gradient buckets and parameter-fetch order are the same on every step.

Routing follows Switch/Qwen2-MoE: the combine weights are the softmax probabilities of the
chosen experts (not renormalised, so the router also learns from the language-model loss at
top-1). The load-balancing loss is Switch/GShard's

    aux = num_experts * sum_e f_e * P_e

with f_e the fraction of (token, slot) assignments sent to expert e (no gradient) and P_e the
mean router probability of e; it is 1 for a perfectly balanced router. The block returns it
beside its output and GPTModel adds it into the loss (see gpt.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.errors import required
from megazpp.model.config import ModelConfig
from megazpp.model.init import Initializer
from megazpp.model.mlp import SwiGLUMLP


class Router(nn.Module):
    """A bias-free linear from hidden to one logit per expert, replicated on every TP rank:
    each rank then routes its (identical) tokens identically."""

    def __init__(self, hidden: int, num_experts: int, name: str, init: Initializer) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        init.normal(f"{name}.weight")(self.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Router probabilities [tokens, experts] in fp32 (the softmax is precision-sensitive)."""
        return torch.softmax(nn.functional.linear(tokens, self.weight).float(), dim=-1)


class MoEMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, name: str, init: Initializer, *, tp_group: ProcessGroup | None) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = Router(cfg.hidden_size, cfg.num_experts, f"{name}.router", init)
        self.experts = nn.ModuleList(
            SwiGLUMLP(
                cfg.hidden_size,
                required(cfg.moe_ffn_hidden_size, "model.moe_ffn_hidden_size"),
                f"{name}.experts.{e}",
                init,
                tp_group=tp_group,
                sequence_parallel=False,
            )
            for e in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output shaped like x, load-balancing loss as a 0-dim fp32 tensor)."""
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        flat_choice = chosen.flatten()
        order = flat_choice.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_choice, minlength=len(self.experts))
        token_of = order // self.top_k
        routed = tokens[token_of]
        outputs, start = [], 0
        for expert, count in zip(self.experts, counts.tolist()):
            outputs.append(expert(routed[start : start + count]))
            start += count
        combine = weights.flatten()[order].to(x.dtype).unsqueeze(-1)
        mixed = torch.zeros_like(tokens).index_add(0, token_of, torch.cat(outputs) * combine)
        fraction = counts.float() / flat_choice.numel()
        aux = len(self.experts) * (fraction * probs.mean(dim=0)).sum()
        return mixed.view_as(x), aux
