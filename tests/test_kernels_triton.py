"""Every Triton kernel, run by Triton's interpreter on CPU tensors, against the torch reference.

Codes and scales must be bit-identical (torch.equal), over block sizes that are and are not
powers of two, sizes that do and do not divide the block size, every input dtype, and inputs
built to hit rounding ties, all-zero and below-TINY blocks, and extreme magnitudes.

TRITON_INTERPRET is read when a kernel is decorated, so it is set before kernels.triton_ops is
imported (a stale, compiled copy of the module is dropped first), and the test checks that the
kernels really are interpreted rather than trusting the environment.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference


def _import_interpreted_triton_ops():
    # Left set for the rest of the process: Triton consults it again on the first launch.
    os.environ["TRITON_INTERPRET"] = "1"
    for name in ("kernels.triton_ops", "kernels.triton_tiles"):
        sys.modules.pop(name, None)
    return importlib.import_module("kernels.triton_ops")


triton_ops = _import_interpreted_triton_ops()
# the GPU check's inputs (tests and check alike); imported after the interpreted module, which it uses
from kernels.cuda_bitwise_check import inputs as _inputs  # noqa: E402
from kernels.triton_geometry import Geometry  # noqa: E402

# (numel, block_size): divides / does not divide; power of two / not; several tiles per launch;
# a block larger than one 4096-element tile (one row per program, 8 warps).
SHAPES = [(1024, 256), (1000, 256), (3 * 2048, 2048), (2048 + 17, 2048), (390, 6), (1234, 100), (8192 + 3, 8192)]


def _error_buffer(numel: int, block_size: int, seed: int, scale: float) -> torch.Tensor:
    """A non-zero fp32 LoCo buffer over the whole blocks of a `numel`-value tensor."""
    blocks = -(-numel // block_size)
    return torch.randn(blocks * block_size, generator=torch.Generator().manual_seed(seed)) * scale


def _same(got, want):
    if isinstance(got, torch.Tensor):
        got, want = (got,), (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), f"{int((g != w).sum())} of {g.numel()} values differ"


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_ops._quantize_kernel, InterpretedFunction)
    assert isinstance(triton_ops._dequant_reduce_kernel, InterpretedFunction)


@pytest.mark.parametrize("numel,block_size", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_and_dequantize_bit_identical(numel, block_size, bits):
    x = _inputs(numel, block_size, seed=numel + bits)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype) if dtype != torch.float16 else x.clamp(-6e4, 6e4).to(dtype)
        want = reference.quantize(xd, bits, block_size)
        _same(triton_ops.quantize(xd, bits, block_size), want)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            _same(
                triton_ops.dequantize(*want, bits, block_size, numel, dtype=out_dtype),
                reference.dequantize(*want, bits, block_size, numel, dtype=out_dtype),
            )


@pytest.mark.parametrize("numel,block_size", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("err_beta", [0.8, 0.0, 1.0])
def test_loco_quantize_bit_identical(numel, block_size, bits, err_beta):
    grad = _inputs(numel, block_size, seed=7 * numel)
    err = _error_buffer(numel, block_size, seed=numel, scale=1.0)
    for dtype in (torch.float32, torch.bfloat16):
        mine, theirs = err.clone(), err.clone()
        got = triton_ops.loco_quantize(grad.to(dtype), mine, err_beta, block_size, bits)
        want = reference.loco_quantize(grad.to(dtype), theirs, err_beta, block_size, bits)
        _same(got, want)
        assert got[2] is mine  # the buffer is updated in place


@pytest.mark.parametrize("numel,block_size", [s for s in SHAPES if s[0] % s[1] == 0] + [(390, 6)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("parts", [1, 3])
def test_dequant_reduce_variants_bit_identical(numel, block_size, bits, parts):
    padded = -(-numel // block_size) * block_size
    quantized = [reference.quantize(_inputs(padded, block_size, seed=p), bits, block_size) for p in range(parts)]
    codes = torch.stack([c for c, _ in quantized])
    scales = torch.stack([s for _, s in quantized])
    _same(
        triton_ops.dequant_reduce(codes, scales, bits, block_size, numel),
        reference.dequant_reduce(codes, scales, bits, block_size, numel),
    )
    for out_bits in (4, 8):
        _same(
            triton_ops.dequant_reduce_quantize(codes, scales, bits, block_size, out_bits),
            reference.dequant_reduce_quantize(codes, scales, bits, block_size, out_bits),
        )
    mine = _inputs(padded, block_size, seed=99) * 1e-2
    theirs = mine.clone()
    _same(
        triton_ops.dequant_reduce_loco_quantize(codes, scales, bits, block_size, mine, 0.8),
        reference.dequant_reduce_loco_quantize(codes, scales, bits, block_size, theirs, 0.8),
    )


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 3000),
    half_block=st.integers(1, 300),
    bits=st.sampled_from([4, 8]),
    log_scale=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_any_size_and_block_bit_identical(numel, half_block, bits, log_scale, seed):
    block_size = 2 * half_block
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * 10.0**log_scale
    want = reference.quantize(x, bits, block_size)
    _same(triton_ops.quantize(x, bits, block_size), want)
    _same(
        triton_ops.dequantize(*want, bits, block_size, numel),
        reference.dequantize(*want, bits, block_size, numel),
    )
    mine = _error_buffer(numel, block_size, seed=seed + 1, scale=0.1 * 10.0**log_scale)
    theirs = mine.clone()
    _same(
        triton_ops.loco_quantize(x, mine, 0.8, block_size, bits),
        reference.loco_quantize(x, theirs, 0.8, block_size, bits),
    )


def test_loco_steps_stay_identical_over_a_run():
    """Errors compound through the buffer; ten chained steps must still agree bit for bit."""
    block, numel = 64, 64 * 5 + 9
    gen = torch.Generator().manual_seed(1)
    mine = torch.zeros(6 * block)  # 6 whole blocks hold the 329 values
    theirs = mine.clone()
    for _ in range(10):
        grad = torch.randn(numel, generator=gen)
        got = triton_ops.loco_quantize(grad, mine, 0.8, block)
        _same(got, reference.loco_quantize(grad, theirs, 0.8, block))


def test_triton_launchers_validate_like_the_reference():

    with pytest.raises(ValueError, match="bits=2"):
        triton_ops.quantize(torch.randn(8), 2, 8)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        triton_ops.quantize(torch.randn(8, dtype=torch.float64), 8, 8)
    codes, scales = reference.quantize(torch.randn(16), 4, 8)
    with pytest.raises(ValueError, match="stacked"):
        triton_ops.dequant_reduce_quantize(codes, scales, 4, 8)
    strided = torch.zeros(32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.loco_quantize(torch.randn(16), strided, 0.8, 8)


@pytest.mark.parametrize("block_size", [100, 256, 1000, 2048, 8192])
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_unrolled_reduce_bit_identical(block_size, parts, bits):
    """The reduce kernel with its compile-time (unrolled) part count: every output kind, block
    sizes from 100 to 8192, a ragged logical length, and a tile that ends past the last block
    (3 blocks, fewer than a program's rows for the small blocks)."""
    blocks = 3
    numel = blocks * block_size - 37
    quantized = [
        reference.quantize(_inputs(blocks * block_size, block_size, seed=11 * p + bits), bits, block_size)
        for p in range(parts)
    ]
    codes = torch.stack([c for c, _ in quantized])
    scales = torch.stack([s for _, s in quantized])
    _same(
        triton_ops.dequant_reduce(codes, scales, bits, block_size, numel),
        reference.dequant_reduce(codes, scales, bits, block_size, numel),
    )
    for out_bits in (4, 8):
        _same(
            triton_ops.dequant_reduce_quantize(codes, scales, bits, block_size, out_bits),
            reference.dequant_reduce_quantize(codes, scales, bits, block_size, out_bits),
        )
        mine = _error_buffer(numel, block_size, seed=parts, scale=0.05)
        theirs = mine.clone()
        _same(
            triton_ops.dequant_reduce_loco_quantize(codes, scales, bits, block_size, mine, 0.8, out_bits),
            reference.dequant_reduce_loco_quantize(codes, scales, bits, block_size, theirs, 0.8, out_bits),
        )


@pytest.mark.parametrize("numel,block_size", [(101, 100), (3 * 1000 - 1, 1000), (2 * 8192 - 5, 8192), (7, 2)])
def test_int4_quantizers_on_ragged_tails(numel, block_size):
    """quantize / LoCo int4 with a tail that ends on an odd or an even element, a block of two
    elements (one packed byte), and an 8192 block (one row per program)."""
    x = _inputs(numel, block_size, seed=numel)
    _same(triton_ops.quantize(x, 4, block_size), reference.quantize(x, 4, block_size))
    mine = _error_buffer(numel, block_size, seed=3, scale=0.5)
    theirs = mine.clone()
    _same(
        triton_ops.loco_quantize(x.to(torch.bfloat16), mine, 0.8, block_size),
        reference.loco_quantize(x.to(torch.bfloat16), theirs, 0.8, block_size),
    )


def test_gpu_bitwise_check_passes_under_the_interpreter(monkeypatch):
    """kernels/cuda_bitwise_check.py (run on the GPU by tools/gpu_check.sh) with `.cuda()` as the
    identity: its cases hold under the interpreter, so a FAIL on a GPU is the compiled code's."""
    from kernels import cuda_bitwise_check

    assert cuda_bitwise_check.triton_ops is triton_ops  # the interpreted module
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    cases = [(label, run) for label, run in cuda_bitwise_check.cases() if "block 8192" not in label]
    assert len(cases) > 80
    assert [(label, problem) for label, run in cases if (problem := run())] == []


# Rows per program 1, 4 and 64 for blocks of 256 (the interpreter ignores the warp count; the
# rows decide which program holds which block, and a last program that is partly past the end).
GEOMETRIES = [Geometry(256, 2), Geometry(1024, 4), Geometry(16384, 8)]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g.elements}x{g.warps}")
def test_every_geometry_gives_the_reference_bits(geometry):
    """The tuned launch geometry cannot change the bits: blocks are independent and whole in
    one program. Every op at a few geometries, 5 blocks and a ragged tail."""
    block, numel = 256, 5 * 256 - 3
    x = _inputs(numel, block, seed=5)
    for bits in (4, 8):
        want = reference.quantize(x, bits, block)
        _same(triton_ops.quantize(x, bits, block, geometry=geometry), want)
        _same(
            triton_ops.dequantize(*want, bits, block, numel, dtype=torch.bfloat16, geometry=geometry),
            reference.dequantize(*want, bits, block, numel, dtype=torch.bfloat16),
        )
        mine = _error_buffer(numel, block, seed=bits, scale=0.1)
        theirs = mine.clone()
        _same(
            triton_ops.loco_quantize(x, mine, 0.8, block, bits, geometry=geometry),
            reference.loco_quantize(x, theirs, 0.8, block, bits),
        )
    parts = [reference.quantize(_inputs(5 * block, block, seed=p), 4, block) for p in range(3)]
    codes, scales = torch.stack([c for c, _ in parts]), torch.stack([s for _, s in parts])
    _same(
        triton_ops.dequant_reduce(codes, scales, 4, block, numel, geometry=geometry),
        reference.dequant_reduce(codes, scales, 4, block, numel),
    )
    _same(
        triton_ops.dequant_reduce_quantize(codes, scales, 4, block, geometry=geometry),
        reference.dequant_reduce_quantize(codes, scales, 4, block),
    )
    mine = _error_buffer(5 * block, block, seed=9, scale=0.1)
    theirs = mine.clone()
    _same(
        triton_ops.dequant_reduce_loco_quantize(codes, scales, 4, block, mine, 0.8, geometry=geometry),
        reference.dequant_reduce_loco_quantize(codes, scales, 4, block, theirs, 0.8),
    )


def test_the_tuner_spans_the_distinct_geometries_and_restores_error_buffers():
    """What the autotuner on a GPU chooses among: for blocks of 256 every candidate is a
    distinct (rows, warps); for blocks of 8192 the candidates collapse to one or two blocks per
    program. A LoCo variant restores its error buffer between trials."""
    from kernels import triton_geometry

    def configs(block_size, restore=()):
        tuner = triton_geometry._tuner(triton_ops._loco_quantize_kernel, block_size, (("BITS", 4),), restore)
        return tuner, sorted((c.kwargs["ROWS"], c.num_warps) for c in tuner.configs)

    _, wide = configs(8192)
    assert wide == [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8)]
    tuner, narrow = configs(256, ("err_ptr",))
    assert len(narrow) == len(triton_geometry.CANDIDATES) and (16, 4) in narrow
    assert tuner.restore_value == ["err_ptr"] and tuner.keys == ["blocks"]
