"""Triton quantization kernels and their host launchers.

The launchers have the signatures of their twins in kernels/reference.py and produce the same
bits, plus a keyword `geometry` (kernels/triton_geometry.py): None, the default, tunes the
launch geometry per GPU and size; a Geometry fixes it (tests, benchmarks).
They run on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1 was set before this
module was imported (that is how the tests check them without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.format import (
    CODE_DTYPE,
    QMAX,
    check_bits,
    check_block_size,
    check_codes,
    check_err_beta,
    check_error_buffer,
    check_float_input,
    check_numel,
    check_out_dtype,
    check_stacked,
    code_bytes_per_block,
    num_blocks,
)
from kernels.reference import all_finite as all_finite  # re-exported: one fused torch reduction on CUDA already
from kernels.triton_geometry import Geometry, launch
from kernels.triton_tiles import cast_rne, load_dequant, loco_tile, quantize_tile, store_codes, tile_rows


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    numel,
    blocks,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
):
    rows, offs, live = tile_rows(tl.program_id(0), blocks, BLOCK, BLOCK_P2, ROWS)
    x = tl.load(x_ptr + offs, mask=live & (offs < numel), other=0.0).to(tl.float32)
    codes, scale = quantize_tile(x, QMAX)
    store_codes(codes_ptr, scales_ptr, rows, blocks, codes, scale, BLOCK, BLOCK_P2, ROWS, BITS)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    numel,
    blocks,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
):
    rows, offs, live = tile_rows(tl.program_id(0), blocks, BLOCK, BLOCK_P2, ROWS)
    x = load_dequant(codes_ptr, scales_ptr, rows, blocks, BLOCK, BLOCK_P2, ROWS, BITS)
    tl.store(out_ptr + offs, cast_rne(x, out_ptr.dtype.element_ty), mask=live & (offs < numel))


@triton.jit
def _loco_quantize_kernel(
    x_ptr,
    err_ptr,
    codes_ptr,
    scales_ptr,
    numel,
    blocks,
    beta,
    keep,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
):
    rows, offs, live = tile_rows(tl.program_id(0), blocks, BLOCK, BLOCK_P2, ROWS)
    x = tl.load(x_ptr + offs, mask=live & (offs < numel), other=0.0).to(tl.float32)
    codes, scale = loco_tile(x, err_ptr, offs, live, beta, keep, QMAX)
    store_codes(codes_ptr, scales_ptr, rows, blocks, codes, scale, BLOCK, BLOCK_P2, ROWS, BITS)


@triton.jit
def _dequant_reduce_kernel(
    in_codes_ptr,
    in_scales_ptr,
    codes_stride,
    scales_stride,
    out_ptr,
    out_codes_ptr,
    out_scales_ptr,
    err_ptr,
    numel,
    blocks,
    beta,
    keep,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    OUT_BITS: tl.constexpr,
    OUT_QMAX: tl.constexpr,
    LOCO: tl.constexpr,
):
    """Sum k dequantized parts in order; write fp32 (OUT_BITS == 0) or re-quantize the sum.

    The part count is a compile-time constant so the loop unrolls: the k parts' loads are
    issued together and overlap in flight. With a runtime trip count each part's loads
    waited for the previous part's (in the PTX: one load of codes and one of scales inside a
    loop), so a program paid k memory round trips one after another and the kernel was
    bound by latency, not bandwidth (docs/arch/kernels.md, "Tiling"). One compiled variant
    per distinct k (the ranks per node: a handful)."""
    rows, offs, live = tile_rows(tl.program_id(0), blocks, BLOCK, BLOCK_P2, ROWS)
    total = tl.zeros((ROWS, BLOCK_P2), dtype=tl.float32)
    for part in tl.static_range(PARTS):
        total = total + load_dequant(
            in_codes_ptr + part * codes_stride,
            in_scales_ptr + part * scales_stride,
            rows,
            blocks,
            BLOCK,
            BLOCK_P2,
            ROWS,
            BITS,
        )
    if OUT_BITS == 0:
        tl.store(out_ptr + offs, total, mask=live & (offs < numel))
    else:
        if LOCO:
            codes, scale = loco_tile(total, err_ptr, offs, live, beta, keep, OUT_QMAX)
        else:
            codes, scale = quantize_tile(total, OUT_QMAX)
        store_codes(out_codes_ptr, out_scales_ptr, rows, blocks, codes, scale, BLOCK, BLOCK_P2, ROWS, OUT_BITS)


def _new_codes(blocks: int, bits: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(blocks * code_bytes_per_block(bits, block_size), dtype=CODE_DTYPE[bits], device=device)
    return codes, torch.empty(blocks, dtype=torch.float32, device=device)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).contiguous()


def _loco_weights(err_beta: float) -> tuple[float, float]:
    """The two blend weights, rounded to fp32 exactly as kernels/reference.py rounds them."""
    err_beta = check_err_beta(err_beta)
    weights = torch.tensor([err_beta, 1.0 - err_beta], dtype=torch.float32)
    return weights[0].item(), weights[1].item()


def quantize(
    x: torch.Tensor, bits: int, block_size: int, *, geometry: Geometry | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a float tensor; returns (codes, fp32 scales), codes padded to whole blocks."""
    check_float_input("quantize input", x)
    check_bits(bits)
    check_block_size(block_size)
    flat = _flat(x)
    blocks = num_blocks(flat.numel(), block_size)
    codes, scales = _new_codes(blocks, bits, block_size, x.device)
    if blocks:
        args = (flat, codes, scales, flat.numel(), blocks)
        launch(_quantize_kernel, blocks, block_size, *args, geometry=geometry, BITS=bits, QMAX=QMAX[bits])
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    numel: int | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    geometry: Geometry | None = None,
) -> torch.Tensor:
    """Decode codes to a flat tensor of `numel` values (default: every block) of `dtype`."""
    blocks = check_codes("dequantize", codes, scales, bits, block_size)
    numel = check_numel(numel, blocks, block_size)
    check_out_dtype(dtype)
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if blocks:
        args = (codes.contiguous(), scales.contiguous(), out, numel, blocks)
        launch(_dequantize_kernel, blocks, block_size, *args, geometry=geometry, BITS=bits)
    return out


def loco_quantize(
    grad: torch.Tensor,
    err: torch.Tensor,
    err_beta: float,
    block_size: int,
    bits: int = 4,
    *,
    geometry: Geometry | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LoCo-quantize `grad`; returns (codes, scales, err), the fp32 error buffer updated in place."""
    check_float_input("loco_quantize grad", grad)
    check_bits(bits)
    beta, keep = _loco_weights(err_beta)
    flat = _flat(grad)
    blocks = num_blocks(flat.numel(), block_size)
    check_error_buffer(err, blocks, block_size, grad.device)
    codes, scales = _new_codes(blocks, bits, block_size, grad.device)
    if blocks:
        args = (flat, err, codes, scales, flat.numel(), blocks, beta, keep)
        launch(
            _loco_quantize_kernel,
            blocks,
            block_size,
            *args,
            geometry=geometry,
            restore=("err_ptr",),
            BITS=bits,
            QMAX=QMAX[bits],
        )
    return codes, scales, err


def _launch_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    *,
    numel: int = 0,
    out: torch.Tensor | None = None,
    out_bits: int = 0,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    err: tuple[torch.Tensor, float, float] | None = None,
    geometry: Geometry | None = None,
) -> None:
    blocks = scales.shape[1]
    if not blocks:
        return
    codes, scales = codes.contiguous(), scales.contiguous()
    err_buf, beta, keep = err if err is not None else (scales, 0.0, 0.0)
    # Pointers a constexpr branch never touches still need a tensor; pass the input scales.
    out = scales if out is None else out
    out_codes = scales if out_codes is None else out_codes
    out_scales = scales if out_scales is None else out_scales
    launch(
        _dequant_reduce_kernel,
        blocks,
        block_size,
        codes,
        scales,
        codes.shape[1],
        scales.shape[1],
        out,
        out_codes,
        out_scales,
        err_buf,
        numel,
        blocks,
        beta,
        keep,
        PARTS=codes.shape[0],
        BITS=bits,
        OUT_BITS=out_bits,
        OUT_QMAX=QMAX.get(out_bits, 0),
        geometry=geometry,
        restore=("err_ptr",) if err is not None else (),
        LOCO=err is not None,
    )


def _reduce_to_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    blocks: int,
    out_bits: int,
    err: tuple[torch.Tensor, float, float] | None,
    geometry: Geometry | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The re-quantized sum's new codes and scales (LoCo-updating `err` when given)."""
    out_codes, out_scales = _new_codes(blocks, out_bits, block_size, codes.device)
    _launch_reduce(
        codes,
        scales,
        bits,
        block_size,
        out_bits=out_bits,
        out_codes=out_codes,
        out_scales=out_scales,
        err=err,
        geometry=geometry,
    )
    return out_codes, out_scales


def dequant_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    numel: int | None = None,
    *,
    geometry: Geometry | None = None,
) -> torch.Tensor:
    """fp32 sum of k quantized tensors stacked as codes [k, bytes], scales [k, blocks]."""
    blocks = check_stacked(codes, scales, bits, block_size)
    numel = check_numel(numel, blocks, block_size)
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    _launch_reduce(codes, scales, bits, block_size, numel=numel, out=out, geometry=geometry)
    return out


def dequant_reduce_quantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    out_bits: int = 4,
    *,
    geometry: Geometry | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum k quantized tensors and re-quantize the sum to `out_bits` (same block size)."""
    blocks = check_stacked(codes, scales, bits, block_size)
    return _reduce_to_codes(codes, scales, bits, block_size, blocks, check_bits(out_bits), None, geometry)


def dequant_reduce_loco_quantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block_size: int,
    err: torch.Tensor,
    err_beta: float,
    out_bits: int = 4,
    *,
    geometry: Geometry | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum k quantized tensors, then LoCo-quantize the sum (second qgZ stage with LoCo)."""
    blocks = check_stacked(codes, scales, bits, block_size)
    check_bits(out_bits)
    beta, keep = _loco_weights(err_beta)
    check_error_buffer(err, blocks, block_size, codes.device)
    out = _reduce_to_codes(codes, scales, bits, block_size, blocks, out_bits, (err, beta, keep), geometry)
    return *out, err
