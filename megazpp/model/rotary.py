"""Rotary position embeddings (RoPE) for Llama.

The rotation pairs dimension i with dimension i + head_dim/2 (the "rotate half" layout of the
Hugging Face Llama code), so Hugging Face Llama weights need no per-head permutation of q/k.
cos/sin are computed in fp32 and cached per (length, device) on a plain object rather than in
a buffer: a buffer would be cast to bf16 by `model.to(bfloat16)` and lose the angles' precision.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Shared by all layers of a model; holds no parameters, only a cache of cos/sin tables."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self._cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [seq_len, head_dim / 2], fp32."""
        key = (seq_len, device)
        if key not in self._cache:
            half = self.head_dim // 2
            inv_freq = 1.0 / self.theta ** (torch.arange(half, dtype=torch.float64) / half)
            angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
            self._cache[key] = (angles.cos().float().to(device), angles.sin().float().to(device))
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [batch, heads, seq, head_dim] by its positions 0..seq-1."""
        cos, sin = self.tables(x.shape[-2], x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
