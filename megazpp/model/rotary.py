"""Rotary position embeddings (RoPE) for Llama.

Dimensions are rotated in adjacent pairs (2i, 2i+1), the layout of Meta's original Llama code,
because then a pair is one complex number and the whole rotation is a single complex multiply:
about 3x faster on CPU than the "rotate half" form with its slices and concatenation. Hugging
Face Llama checkpoints store q/k rows permuted for "rotate half"; a converter undoes that
permutation (the inverse of the one Hugging Face's own conversion script applies).

The rotation runs in fp32 (complex64) whatever the activation dtype, and the angles are cached
per (length, device) on a plain object rather than in a buffer: a buffer would be cast to bf16
by `model.to(bfloat16)` and lose the angles' precision.

Under `torch.compile` (`training.compile`) the same rotation is written in real arithmetic,
out = (x0 c - x1 s, x0 s + x1 c) with c, s the fp32 parts of the same cached rotation:
TorchInductor generates no code for complex tensors (it falls back to an eager kernel and
splits the layer's fused region there), while the real form fuses into the neighbouring
loops. Eager keeps the single complex multiply, the fastest form there. The two agree to
within the rounding of the four products and two sums, about 2**-23 (|x0| + |x1|) per element
(each fp32 operation rounds once, and the complex multiply may contract a product into an
FMA), so a compiled run does not match an eager one bit for bit; tests/test_model_compile.py
bounds the difference.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Shared by all layers of a model; holds no parameters, only a cache of rotations."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._real_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _angles(self, seq_len: int) -> torch.Tensor:
        """position * theta^(-2k / head_dim) in fp64, [seq_len, head_dim / 2]: on the host on
        purpose, so every device gets the same rotations (moved there once, cached)."""
        half = self.head_dim // 2
        inv_freq = self.theta ** (-torch.arange(half, dtype=torch.float64, device="cpu") / half)
        return torch.outer(torch.arange(seq_len, dtype=torch.float64, device="cpu"), inv_freq)

    def rotations(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """exp(i * position * theta^(-2k / head_dim)) as complex64 [seq_len, head_dim / 2]."""
        key = (seq_len, device)
        if key not in self._cache:
            angles = self._angles(seq_len)
            self._cache[key] = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)
        return self._cache[key]

    def real_rotations(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the same angles as fp32 [seq_len, head_dim / 2], computed without
        complex numbers so that a compiled layer can fill the cache inside its graph."""
        key = (seq_len, device)
        if key not in self._real_cache:
            angles = self._angles(seq_len)
            self._real_cache[key] = (angles.cos().float().to(device), angles.sin().float().to(device))
        return self._real_cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [batch, seq, ..., head_dim] by its positions 0..seq-1."""
        if torch.compiler.is_compiling():
            return self.apply_real(x)
        seq_len = x.shape[1]
        rotation = self.rotations(seq_len, x.device)
        rotation = rotation.view(seq_len, *([1] * (x.dim() - 3)), self.head_dim // 2)
        pairs = torch.view_as_complex(x.float().unflatten(-1, (self.head_dim // 2, 2)))
        return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)

    def apply_real(self, x: torch.Tensor) -> torch.Tensor:
        """`apply` in real arithmetic (what a compiled layer runs)."""
        seq_len = x.shape[1]
        cos, sin = self.real_rotations(seq_len, x.device)
        shape = (seq_len, *([1] * (x.dim() - 3)), self.head_dim // 2)
        cos, sin = cos.view(shape), sin.view(shape)
        pairs = x.float().unflatten(-1, (self.head_dim // 2, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
