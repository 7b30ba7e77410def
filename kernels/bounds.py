"""Worst-case quantization error bounds, for tests that compare quantized paths to exact ones.

Derivations are in docs/arch/kernels.md. With u = 2**-24 (fp32 unit roundoff), a block with
absolute maximum A >= TINY_ABSMAX and scale s = fl(A / qmax) decodes every element x to x_hat with

    |x - x_hat| <= s / 2 + 2**-21 * A <= s * (1/2 + qmax * 2**-20)

(the s/2 is rounding to the grid; the rest covers the four fp32 roundings of scale, reciprocal,
product and decode). A block below TINY_ABSMAX decodes to zeros, off by less than TINY_ABSMAX.

Re-derived for the two-addition rounding (kernels/format.py, ROUND_MAGIC), which replaced
`torch.round(...).clamp(...)`: with t = fl(x * fl(qmax / A)), |t| <= qmax (1 + u)**2 < 2**22, so
fl(t + M) = M + rint(t) exactly (fp32 spacing is 1 on [2**23, 2**24); ties go to the even sum,
and M = 1.5 * 2**23 is even) and fl(fl(t + M) - M) = rint(t) exactly (a difference of two
integers below 2**24). The code is therefore the same c = rint(t) with |t - c| <= 1/2, and
|t| < qmax + 1/2 keeps c in [-qmax, qmax] without the clamp, which was a no-op. No rounding was
added or removed from the chain above, so the bound is unchanged term for term. It relies on the
two additions being rounded separately (no FMA contraction of x * inv into the first, no
reassociation): how each implementation ensures that is in kernels/format.py.
"""

from __future__ import annotations

import torch

from kernels.format import QMAX, TINY_ABSMAX, check_bits, check_block_size, num_blocks

# The qgZ bound below is stated for at most this many data-parallel ranks: the fp32 summation
# error grows with the number of terms and is absorbed into the factor (1 + 2**-10) only up to here.
QGZ_MAX_RANKS = 1024


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block absolute maximum [blocks] of a flat tensor (tail block zero-padded)."""
    check_block_size(block_size)
    flat = x.reshape(-1).to(torch.float32)
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size).abs().amax(dim=1)


def quantization_error_bound(
    scales: torch.Tensor, bits: int, block_size: int, numel: int | None = None
) -> torch.Tensor:
    """Per-element bound on |x - dequantize(quantize(x))| from the stored scales, flat [numel]."""
    qmax = QMAX[check_bits(bits)]
    check_block_size(block_size)
    per_block = torch.where(scales > 0, scales * (0.5 + qmax * 2.0**-20), torch.full_like(scales, TINY_ABSMAX))
    flat = per_block.repeat_interleave(block_size)
    return flat if numel is None else flat[:numel]


def qgz_error_bound(grads: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-element bound on |qgZ sum - exact sum| for two int4 stages, flat [numel].

    `grads` stacks every data-parallel rank's flat gradient bucket as [ranks, numel], quantized
    with `block_size` at stage 1, reduced and re-quantized with the same block size at stage 2,
    every all-to-all chunk block-aligned (so each stage-2 block covers the same elements as one
    stage-1 block of every sender). The bound is (1 + 2**-10) / 7 * sum_r A_r(block), A_r the
    block absmax of rank r's gradient; divide by the rank count for the averaged gradient. It
    does not hold with LoCo on, which transmits g + error rather than g.
    """
    if grads.dim() != 2:
        raise ValueError(f"qgz_error_bound expects grads stacked as [ranks, numel], got {tuple(grads.shape)}")
    ranks, numel = grads.shape
    if ranks > QGZ_MAX_RANKS:
        raise ValueError(f"qgz_error_bound is derived for at most {QGZ_MAX_RANKS} ranks, got {ranks}")
    absmax_sum = torch.stack([block_absmax(g, block_size) for g in grads]).sum(dim=0)
    # Blocks below TINY_ABSMAX decode to zero, off by less than TINY_ABSMAX per stage and sender.
    bound = (1 + 2.0**-10) / 7 * absmax_sum + 2 * ranks * TINY_ABSMAX
    return bound.repeat_interleave(block_size)[:numel]
