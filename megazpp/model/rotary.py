"""Rotary position embeddings (RoPE) for Llama.

Dimensions are rotated in adjacent pairs (2i, 2i+1), the layout of Meta's original Llama code,
because then a pair is one complex number and the whole rotation is a single complex multiply:
about 3x faster on CPU than the "rotate half" form with its slices and concatenation. Hugging
Face Llama checkpoints store q/k rows permuted for "rotate half"; a converter undoes that
permutation (the inverse of the one Hugging Face's own conversion script applies).

The rotation runs in fp32 (complex64) whatever the activation dtype, and the angles are cached
per (length, device) on a plain object rather than in a buffer: a buffer would be cast to bf16
by `model.to(bfloat16)` and lose the angles' precision.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Shared by all layers of a model; holds no parameters, only a cache of rotations."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def rotations(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """exp(i * position * theta^(-2k / head_dim)) as complex64 [seq_len, head_dim / 2]."""
        key = (seq_len, device)
        if key not in self._cache:
            half = self.head_dim // 2
            inv_freq = self.theta ** (-torch.arange(half, dtype=torch.float64) / half)
            angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
            self._cache[key] = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [batch, seq, ..., head_dim] by its positions 0..seq-1."""
        seq_len = x.shape[1]
        rotation = self.rotations(seq_len, x.device)
        rotation = rotation.view(seq_len, *([1] * (x.dim() - 3)), self.head_dim // 2)
        pairs = torch.view_as_complex(x.float().unflatten(-1, (self.head_dim // 2, 2)))
        return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
