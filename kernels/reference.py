"""Pure-torch twins of the Triton kernels: the CPU implementation and the tests' oracle.

Each function performs exactly the fp32 operations of its Triton kernel, one rounding per
operation and in the same order, so the integer codes and scales agree bit for bit:

    absmax = max |x| over the block            (exact)
    scale  = absmax / qmax                     (IEEE division)
    inv    = qmax / absmax                     (IEEE division; scale = inv = 0 when absmax < TINY)
    t      = x * inv
    code   = (t + ROUND_MAGIC) - ROUND_MAGIC       (round half to even, exact: format.ROUND_MAGIC)
    x_hat  = code * scale

No clamp: |t| <= qmax (1 + u)**2 < qmax + 1/2 (|x| <= absmax, and inv is qmax / absmax rounded
once), so the rounded code is already in [-qmax, qmax]. The rounding is bit-identical to
`torch.round` on every code (only the sign of a zero code may differ, and codes are stored as
integers), so codes written before this rounding decode and continue unchanged.

Sums over k received chunks run in chunk order starting from 0, one rounding per addition, so
this file never calls torch.sum (whose order is unspecified). Divisions are written as tensor by
tensor, because `number / tensor` in torch multiplies by a reciprocal instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.format import (
    QMAX,
    ROUND_MAGIC,
    TINY_ABSMAX,
    check_bits,
    check_block_size,
    check_codes,
    check_err_beta,
    check_error_buffer,
    check_float_input,
    check_numel,
    check_out_dtype,
    check_stacked,
    num_blocks,
)


def _tile(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """View a tensor as fp32 [blocks, block_size], zero-padding the tail block."""
    flat = x.reshape(-1).to(torch.float32)
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def quantize_tile(tile: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (as fp32 integers) and per-row scales of an fp32 [blocks, block_size] tile."""
    qmax = torch.tensor(float(QMAX[bits]), dtype=torch.float32, device=tile.device)
    absmax = tile.abs().amax(dim=1)
    live = absmax >= TINY_ABSMAX
    safe = torch.where(live, absmax, torch.ones_like(absmax))
    scale = torch.where(live, safe / qmax, torch.zeros_like(absmax))
    inv = torch.where(live, qmax / safe, torch.zeros_like(absmax))
    codes = (tile * inv[:, None] + ROUND_MAGIC) - ROUND_MAGIC
    return codes, scale


def encode(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Store fp32 integer codes [blocks, block_size] in the flat int8 / packed-int4 layout."""
    ints = codes.to(torch.int32)
    if bits == 8:
        return ints.to(torch.int8).reshape(-1)
    nibbles = ints & 0xF
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8).reshape(-1)


def decode(codes: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """fp32 integer codes [..., blocks, block_size] of a flat (or k-stacked) code tensor."""
    lead = codes.shape[:-1]
    if bits == 8:
        return codes.to(torch.float32).reshape(*lead, -1, block_size)
    packed = codes.to(torch.int32)
    low = ((packed & 0xF) ^ 8) - 8
    high = ((packed >> 4) ^ 8) - 8
    return torch.stack([low, high], dim=-1).to(torch.float32).reshape(*lead, -1, block_size)


def _dequant_tile(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    return decode(codes, bits, block_size) * scales[..., None]


def _loco_tile(
    values: torch.Tensor, err: torch.Tensor, err_beta: float, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error-compensate, quantize, and blend the new error into the fp32 buffer (LoCo)."""
    beta = torch.tensor(err_beta, dtype=torch.float32, device=values.device)
    keep = torch.tensor(1.0 - err_beta, dtype=torch.float32, device=values.device)
    old_err = err.view(values.shape)
    compensated = values + old_err
    codes, scales = quantize_tile(compensated, bits)
    new_err = compensated - codes * scales[:, None]
    return codes, scales, beta * old_err + keep * new_err


def _quantize_blocks(tile: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize_tile(tile, bits)
    return encode(codes, bits), scales


def _loco_blocks(
    tile: torch.Tensor, err: torch.Tensor, err_beta: float, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scales, new_err = _loco_tile(tile, err, err_beta, bits)
    return encode(codes, bits), scales, new_err.reshape(-1)


def _reduce_tile(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    total = torch.zeros(scales.shape[1], block_size, dtype=torch.float32, device=codes.device)
    for part in range(codes.shape[0]):
        total = total + _dequant_tile(codes[part], scales[part], bits, block_size)
    return total


def _reduce_quantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, out_bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_blocks(_reduce_tile(codes, scales, bits, block_size), out_bits)


def _reduce_loco_blocks(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    err: torch.Tensor,
    err_beta: float,
    out_bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _loco_blocks(_reduce_tile(codes, scales, bits, block_size), err, err_beta, out_bits)


@dataclass(frozen=True)
class Arithmetic:
    """The whole-block arithmetic of every op, on [blocks, block_size] tiles, apart from the
    checks, padding, slicing and dtype casts around it. The public ops run these eager functions
    by default; kernels/cpu_compiled.py hands them the same functions compiled (only whole
    blocks reach the compiler: Inductor once miscompiled a bf16 cast of a ragged tail)."""

    quantize: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = _quantize_blocks
    dequantize: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] = _dequant_tile
    loco: Callable[[torch.Tensor, torch.Tensor, float, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (
        _loco_blocks
    )
    reduce: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor] = _reduce_tile
    reduce_quantize: Callable[[torch.Tensor, torch.Tensor, int, int, int], tuple[torch.Tensor, torch.Tensor]] = (
        _reduce_quantize_blocks
    )
    reduce_loco: Callable[
        [torch.Tensor, torch.Tensor, int, int, torch.Tensor, float, int],
        tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ] = _reduce_loco_blocks


EAGER = Arithmetic()


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """0-d bool: every value of `x` is finite (qgZ checks a gradient before quantizing it, since
    a NaN block would quantize to zeros and hide the overflow)."""
    return torch.isfinite(x).all()


def quantize(
    x: torch.Tensor, bits: int, block_size: int, *, arith: Arithmetic = EAGER
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a float tensor; returns (codes, fp32 scales), codes padded to whole blocks."""
    check_float_input("quantize input", x)
    check_bits(bits)
    check_block_size(block_size)
    return arith.quantize(_tile(x, block_size), bits)


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    numel: int | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    arith: Arithmetic = EAGER,
) -> torch.Tensor:
    """Decode codes to a flat tensor of `numel` values (default: every block) of `dtype`."""
    blocks = check_codes("dequantize", codes, scales, bits, block_size)
    numel = check_numel(numel, blocks, block_size)
    check_out_dtype(dtype)
    return arith.dequantize(codes, scales, bits, block_size).reshape(-1)[:numel].to(dtype)


def loco_quantize(
    grad: torch.Tensor,
    err: torch.Tensor,
    err_beta: float,
    block_size: int,
    bits: int = 4,
    *,
    arith: Arithmetic = EAGER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LoCo-quantize `grad`; returns (codes, scales, err), the fp32 error buffer updated in place."""
    check_float_input("loco_quantize grad", grad)
    check_bits(bits)
    err_beta = check_err_beta(err_beta)
    check_error_buffer(err, num_blocks(grad.numel(), block_size), block_size, grad.device)
    codes, scales, new_err = arith.loco(_tile(grad, block_size), err, err_beta, bits)
    err.copy_(new_err)
    return codes, scales, err


def dequant_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    numel: int | None = None,
    *,
    arith: Arithmetic = EAGER,
) -> torch.Tensor:
    """fp32 sum of k quantized tensors stacked as codes [k, bytes], scales [k, blocks]."""
    blocks = check_stacked(codes, scales, bits, block_size)
    total = arith.reduce(codes, scales, bits, block_size)
    return total.reshape(-1)[: check_numel(numel, blocks, block_size)]


def dequant_reduce_quantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    out_bits: int = 4,
    *,
    arith: Arithmetic = EAGER,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum k quantized tensors and re-quantize the sum to `out_bits` (same block size)."""
    check_bits(out_bits)
    check_stacked(codes, scales, bits, block_size)
    return arith.reduce_quantize(codes, scales, bits, block_size, out_bits)


def dequant_reduce_loco_quantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    err: torch.Tensor,
    err_beta: float,
    out_bits: int = 4,
    *,
    arith: Arithmetic = EAGER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum k quantized tensors, then LoCo-quantize the sum (second qgZ stage with LoCo)."""
    check_bits(out_bits)
    err_beta = check_err_beta(err_beta)
    blocks = check_stacked(codes, scales, bits, block_size)
    check_error_buffer(err, blocks, block_size, codes.device)
    q, s, new_err = arith.reduce_loco(codes, scales, bits, block_size, err, err_beta, out_bits)
    err.copy_(new_err)
    return q, s, err
