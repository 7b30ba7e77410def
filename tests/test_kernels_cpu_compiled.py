"""The TorchInductor-compiled CPU kernels against the eager torch reference: same bits.

`zero.cpu_quant_kernels: compiled` is only worth having if it is the reference, faster; so
codes, scales, decoded values and LoCo buffers must be torch.equal to the eager ops, over
sizes that do and do not divide the block (each a compilation of its own: shapes are
static), bf16 input, and blocks that are all zero or below TINY; and the overflow check
qgZ runs before quantizing must see every NaN and infinity.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference
from kernels.format import TINY_ABSMAX

COMPILED = kernels.kernel_set("compiled")
SIZES = [(4096, 256), (4096 + 100, 128)]


def _values(numel: int, block: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.logspace(-3, 3, numel)
    x[:block] = 0.0
    x[block : 2 * block] = TINY_ABSMAX / 3
    return x


def _equal(got, want) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_and_dequantize_match_reference(bits):
    for numel, block in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            x = _values(numel, block, numel).to(dtype)
            codes, scales = COMPILED.quantize(x, bits, block)
            _equal((codes, scales), reference.quantize(x, bits, block))
            _equal(
                COMPILED.dequantize(codes, scales, bits, block, numel, dtype=dtype),
                reference.dequantize(codes, scales, bits, block, numel, dtype=dtype),
            )


def test_reductions_and_loco_match_reference():
    for numel, block in SIZES:
        parts = [reference.quantize(_values(numel, block, seed), 4, block) for seed in range(3)]
        codes = torch.stack([c for c, _ in parts])
        scales = torch.stack([s for _, s in parts])
        _equal(
            COMPILED.dequant_reduce(codes, scales, 4, block, numel),
            reference.dequant_reduce(codes, scales, 4, block, numel),
        )
        _equal(
            COMPILED.dequant_reduce_quantize(codes, scales, 4, block),
            reference.dequant_reduce_quantize(codes, scales, 4, block),
        )
        mine, theirs = kernels.new_error_buffer(numel, block), kernels.new_error_buffer(numel, block)
        for step in range(3):  # the error buffer carries over: later steps see a non-zero one
            grad = _values(numel, block, 100 + step)
            _equal(COMPILED.loco_quantize(grad, mine, 0.8, block), reference.loco_quantize(grad, theirs, 0.8, block))
            _equal(
                COMPILED.dequant_reduce_loco_quantize(codes, scales, 4, block, mine, 0.8),
                reference.dequant_reduce_loco_quantize(codes, scales, 4, block, theirs, 0.8),
            )


def test_all_finite_sees_every_nan_and_infinity():
    x = _values(5000, 256, 7)
    assert bool(COMPILED.all_finite(x)) and bool(reference.all_finite(x))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 2500, 4999):
            y = x.clone()
            y[where] = bad
            assert not bool(COMPILED.all_finite(y)) and not bool(reference.all_finite(y))


def test_bad_choices_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="CPU kernels 'fast': expected one of"):
        kernels.kernel_set("fast")
    from kernels import cpu_compiled

    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="need a C\\+\\+ compiler"):
        cpu_compiled.require_compiler()


_QUANTIZE_MATCHES = """
import torch, kernels
from kernels import reference
x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 50
got, want = kernels.kernel_set("compiled").quantize(x, 8, 256), reference.quantize(x, 8, 256)
print(all(torch.equal(g, w) for g, w in zip(got, want)), torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.slow
def test_a_kernel_compiled_under_one_isa_is_not_reused_under_another(tmp_path):
    """Inductor's disk cache is not keyed by the vector ISA (torch 2.13): a quantize compiled
    under AVX-512 and read back under AVX2 returned wrong codes until the cache was split per
    ISA. Two processes share one cache directory, the first with the CPU's widest vectors
    (AVX-512 where the CPU has it; elsewhere both legs are AVX2 and the test shows reuse)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for capability in ("avx512", "avx2"):
        env = dict(
            os.environ,
            ATEN_CPU_CAPABILITY=capability,
            TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
            PYTHONPATH=root,
            OMP_NUM_THREADS="1",
        )
        out = subprocess.run(
            [sys.executable, "-c", _QUANTIZE_MATCHES], env=env, cwd=root, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[0] == "True", (capability, out.stdout)


def test_the_cache_directory_names_the_isa_once(monkeypatch, tmp_path):
    """The subdirectory is chosen once per process and never nested under another ISA's."""
    from kernels import cpu_compiled

    for base in (tmp_path, tmp_path / "isa-avx2"):
        cpu_compiled.separate_cache_per_isa.cache_clear()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(base))
        chosen = cpu_compiled.separate_cache_per_isa()
        assert os.path.dirname(chosen) == str(tmp_path) and os.path.basename(chosen).startswith("isa-")
    cpu_compiled.separate_cache_per_isa.cache_clear()
