"""The block-quantized format shared by the Triton kernels, the torch reference and their callers.

A flat tensor of `numel` values is cut into blocks of `block_size` consecutive elements; the last
block is padded with zeros up to a full block, so every code buffer covers whole blocks and a
bucket can be split into block-aligned chunks for an all-to-all without a per-size fallback.
Each block has one fp32 scale. Codes are symmetric integers in [-qmax, qmax]:

* int8: one `torch.int8` code per element, qmax = 127.
* int4: two codes per `torch.uint8` byte, qmax = 7 (-8 is never produced, so the grid stays
  symmetric). Element 2i of a block sits in the low nibble (bits 0-3) and element 2i+1 in the
  high nibble (bits 4-7), each as a 4-bit two's complement number.

Everything here is plain Python so both implementations and the ZeRO engine agree on sizes and
on what counts as bad input without importing Triton.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}
CODE_DTYPE = {8: torch.int8, 4: torch.uint8}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A block whose absolute maximum is below this is stored as scale 0 and all-zero codes. The
# encoder multiplies by qmax / absmax; this floor keeps that reciprocal finite (127 * 2**120 is
# below the fp32 maximum) so no block ever produces inf or NaN codes.
TINY_ABSMAX = 2.0**-120

# Rounding to the nearest integer, ties to even, in two exact-by-construction fp32 additions:
# for |t| <= 2**22, t + 1.5 * 2**23 lies in [2**23, 2**24), where fp32's spacing is 1, so the
# sum is rounded to an integer, ties to the even sum (1.5 * 2**23 is even, so that is the even
# integer), and subtracting the constant back is exact. Codes reach |t| <= qmax (1 + u)**2, far
# inside that range. Two additions instead of the floor-based rounding (about twelve operations
# per element on a GPU, where libdevice's rint is missing from Triton's interpreter). Every
# implementation writes `(t + ROUND_MAGIC) - ROUND_MAGIC` as two separate roundings: no
# reassociation (which would fold it to t) and no multiply-add contraction of the product t
# into the first addition (kernels/cpu_compiled.py pins both compiler settings; the Triton
# kernels launch with enable_fp_fusion=False).
ROUND_MAGIC = 1.5 * 2**23

# One tile must fit in a Triton program's registers; larger blocks would spill badly on a GPU.
MAX_BLOCK_SIZE = 16384

DEFAULT_BLOCK_SIZE = {4: 256, 8: 2048}


def check_bits(bits: int) -> int:
    """Raise ValueError unless `bits` is a supported code width (4 or 8)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in QMAX:
        raise ValueError(f"quantization bits={bits!r} is not supported; expected 4 or 8")
    return bits


def check_block_size(block_size: int) -> int:
    """Raise ValueError unless `block_size` is an even int in [2, MAX_BLOCK_SIZE].

    Even, so that an int4 block never shares a byte with the next block.
    """
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or block_size < 2
        or block_size % 2
        or block_size > MAX_BLOCK_SIZE
    ):
        raise ValueError(
            f"quantization block_size={block_size!r} is invalid; expected an even integer "
            f"between 2 and {MAX_BLOCK_SIZE}"
        )
    return block_size


def check_float_input(name: str, x: torch.Tensor) -> None:
    """Raise ValueError unless `x` is a float tensor the kernels can read."""
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {x.dtype}; the quantization kernels accept {', '.join(str(d) for d in FLOAT_DTYPES)}"
        )


def check_err_beta(err_beta: float) -> float:
    """Raise ValueError unless the LoCo blend weight lies in [0, 1]."""
    if not 0.0 <= float(err_beta) <= 1.0:
        raise ValueError(f"LoCo err_beta={err_beta!r} must lie in [0, 1]")
    return float(err_beta)


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks needed to hold `numel` values, the last one padded."""
    return (numel + block_size - 1) // block_size


def padded_numel(numel: int, block_size: int) -> int:
    """Elements covered by the codes of a `numel`-value tensor (whole blocks)."""
    return num_blocks(numel, block_size) * block_size


def code_bytes_per_block(bits: int, block_size: int) -> int:
    """Length of one block's codes in the code tensor (int4 packs two values per byte)."""
    return block_size * check_bits(bits) // 8


def check_codes(name: str, codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> int:
    """Validate a (codes, scales) pair of one quantized tensor; return its block count.

    `codes` and `scales` may carry a leading dimension (k tensors stacked for a reduction);
    the trailing dimension is what one quantized tensor holds.
    """
    check_bits(bits)
    check_block_size(block_size)
    if codes.dtype != CODE_DTYPE[bits]:
        raise ValueError(f"{name} codes have dtype {codes.dtype}; int{bits} codes are stored as {CODE_DTYPE[bits]}")
    if scales.dtype != torch.float32:
        raise ValueError(f"{name} scales have dtype {scales.dtype}; expected torch.float32")
    if codes.dim() != scales.dim() or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"{name} codes shape {tuple(codes.shape)} and scales shape {tuple(scales.shape)} "
            "disagree in their leading dimensions"
        )
    blocks = scales.shape[-1]
    expected = blocks * code_bytes_per_block(bits, block_size)
    if codes.shape[-1] != expected:
        raise ValueError(
            f"{name} codes hold {codes.shape[-1]} bytes per tensor but {blocks} blocks of "
            f"{block_size} int{bits} values need {expected}"
        )
    if codes.device != scales.device:
        raise ValueError(f"{name} codes are on {codes.device} but scales on {scales.device}")
    return blocks


def check_numel(numel: int | None, blocks: int, block_size: int) -> int:
    """Resolve the logical length of a dequantized tensor (default: all blocks)."""
    full = blocks * block_size
    if numel is None:
        return full
    if not full - block_size < numel <= full and not (numel == 0 and blocks == 0):
        raise ValueError(
            f"numel={numel} does not fit {blocks} blocks of {block_size}: expected a value in "
            f"({full - block_size}, {full}]"
        )
    return numel


def check_stacked(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> int:
    """Validate k quantized tensors stacked as codes [k, bytes], scales [k, blocks]."""
    blocks = check_codes("dequant_reduce", codes, scales, bits, block_size)
    if codes.dim() != 2 or codes.shape[0] < 1:
        raise ValueError(f"dequant_reduce expects codes stacked as [k >= 1, bytes], got shape {tuple(codes.shape)}")
    return blocks


def check_error_buffer(err: torch.Tensor, blocks: int, block_size: int, device: torch.device) -> None:
    """Raise ValueError unless the LoCo buffer is a flat, contiguous fp32 tensor of `blocks`
    whole blocks on `device` (it is updated in place)."""
    if not isinstance(err, torch.Tensor) or err.dtype != torch.float32:
        raise ValueError(
            f"LoCo error buffer must be an fp32 tensor, got "
            f"{err.dtype if isinstance(err, torch.Tensor) else type(err).__name__}"
        )
    if err.device != device:
        raise ValueError(f"LoCo error buffer is on {err.device} but the values it corrects are on {device}")
    if err.dim() != 1 or err.numel() != blocks * block_size or not err.is_contiguous():
        raise ValueError(
            f"LoCo error buffer has shape {tuple(err.shape)} but the quantized tensor has {blocks} blocks "
            f"of {block_size}: expected a contiguous 1-D buffer of {blocks * block_size} values"
        )


def check_out_dtype(dtype: torch.dtype) -> None:
    """Raise ValueError unless dequantized values can be written as `dtype`."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dequantize output dtype {dtype} is not supported; expected fp32, bf16 or fp16")
