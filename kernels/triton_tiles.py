"""Triton device functions shared by the quantization kernels (see kernels/format.py for layout).

Every kernel program handles a tile of ROWS consecutive quantization blocks, each block a row of
BLOCK_P2 lanes (block_size rounded up to a power of two, which `tl.arange` needs); lanes past the
block and rows past the last block are masked, so any even block size works. The arithmetic is
the sequence of fp32 operations spelled out in kernels/reference.py, with IEEE division
(`div_rn`), the two-addition round-half-to-even of kernels/format.py (ROUND_MAGIC), and the
kernels are launched with fp fusion off so no multiply-add is contracted into an FMA on a GPU
(that would fold the product into the rounding's first addition).
"""

import triton
import triton.language as tl

from kernels.format import ROUND_MAGIC, TINY_ABSMAX

TINY: tl.constexpr = tl.constexpr(TINY_ABSMAX)
MAGIC: tl.constexpr = tl.constexpr(ROUND_MAGIC)


@triton.jit
def tile_rows(pid, blocks, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr):
    """Block indices, flat element offsets and the in-block mask of this program's tile."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_P2)
    offs = rows[:, None].to(tl.int64) * BLOCK + cols[None, :]
    live = (rows[:, None] < blocks) & (cols[None, :] < BLOCK)
    return rows, offs, live


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE rounding to nearest even, spelled out for bf16 (the interpreter truncates)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def quantize_tile(x, QMAX: tl.constexpr):
    """fp32 integer codes of a [ROWS, BLOCK_P2] tile and one scale per row."""
    absmax = tl.max(tl.abs(x), axis=1)
    live = absmax >= TINY
    safe = tl.where(live, absmax, 1.0)
    qmax = tl.full(absmax.shape, QMAX, tl.float32)
    scale = tl.where(live, tl.math.div_rn(safe, qmax), 0.0)
    inv = tl.where(live, tl.math.div_rn(qmax, safe), 0.0)
    # round half to even in two fp32 additions; no clamp needed (kernels/reference.py says why)
    codes = (x * inv[:, None] + MAGIC) - MAGIC
    return codes, scale


@triton.jit
def store_codes(
    codes_ptr,
    scales_ptr,
    rows,
    blocks,
    codes,
    scale,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
):
    """Write a tile's codes (int8, or int4 packed low nibble first) and its scales."""
    row_live = rows < blocks
    tl.store(scales_ptr + rows, scale, mask=row_live)
    if BITS == 8:
        cols = tl.arange(0, BLOCK_P2)
        offs = rows[:, None].to(tl.int64) * BLOCK + cols[None, :]
        tl.store(codes_ptr + offs, codes.to(tl.int8), mask=row_live[:, None] & (cols[None, :] < BLOCK))
    else:
        even, odd = tl.split(tl.reshape(codes.to(tl.int32), (ROWS, BLOCK_P2 // 2, 2)))
        packed = ((even & 15) | ((odd & 15) << 4)).to(tl.uint8)
        cols = tl.arange(0, BLOCK_P2 // 2)
        offs = rows[:, None].to(tl.int64) * (BLOCK // 2) + cols[None, :]
        tl.store(codes_ptr + offs, packed, mask=row_live[:, None] & (cols[None, :] < BLOCK // 2))


@triton.jit
def load_dequant(
    codes_ptr,
    scales_ptr,
    rows,
    blocks,
    BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
):
    """Dequantized fp32 [ROWS, BLOCK_P2] tile (zeros outside the blocks)."""
    row_live = rows < blocks
    scale = tl.load(scales_ptr + rows, mask=row_live, other=0.0)
    if BITS == 8:
        cols = tl.arange(0, BLOCK_P2)
        offs = rows[:, None].to(tl.int64) * BLOCK + cols[None, :]
        mask = row_live[:, None] & (cols[None, :] < BLOCK)
        codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32)
    else:
        cols = tl.arange(0, BLOCK_P2 // 2)
        offs = rows[:, None].to(tl.int64) * (BLOCK // 2) + cols[None, :]
        mask = row_live[:, None] & (cols[None, :] < BLOCK // 2)
        packed = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        low = ((packed & 15) ^ 8) - 8
        high = ((packed >> 4) ^ 8) - 8
        codes = tl.reshape(tl.join(low, high), (ROWS, BLOCK_P2)).to(tl.float32)
    return codes * scale[:, None]


@triton.jit
def loco_tile(
    values,
    err_ptr,
    offs,
    live,
    beta,
    keep,
    QMAX: tl.constexpr,
):
    """Add the fp32 error buffer, quantize, blend the new error into the buffer (in place)."""
    old_err = tl.load(err_ptr + offs, mask=live, other=0.0)
    compensated = values + old_err
    codes, scale = quantize_tile(compensated, QMAX)
    new_err = compensated - codes * scale[:, None]
    tl.store(err_ptr + offs, beta * old_err + keep * new_err, mask=live)
    return codes, scale
