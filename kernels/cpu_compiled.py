"""The torch reference ops compiled by TorchInductor into fused C++ loops, for CPU ranks.

Why: eager torch runs every line of kernels/reference.py as its own pass over memory (a
quantize is about ten passes), so on CPU ranks ZeRO++ spent more host time quantizing than
it saved on the link. Compiling the very same source (`reference.Arithmetic`, the whole-block
part of each op; the checks, padding and casts around it stay eager) fuses those passes into
one or two loops; the arithmetic is unchanged (no reciprocal for a division, sums in the same order), so the
codes and scales are the reference's bit for bit, which tests/test_kernels_cpu_compiled.py
checks. That needs the C++ compiler to keep one rounding per operation: no multiply-add
contraction and no reassociation (either would fold the rounding's `(t + ROUND_MAGIC) -
ROUND_MAGIC`, kernels/format.py); both are Inductor's defaults but settable from the
environment, so `_compile` pins them (`EXACT_FP`).

Shapes are compiled static: with symbolic sizes Inductor's loops did not vectorize
(the int4 dequantize-reduce ran 3x slower), and a run has only a few bucket sizes, each
compiled once per process (and cached on disk across processes).

Selected by `zero.cpu_quant_kernels: compiled`; needs a C++ compiler on the ranks' machines
(TorchInductor's CPU backend calls it once per op, cached on disk afterwards).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from kernels import reference

OPS = (
    "all_finite",
    "quantize",
    "dequantize",
    "loco_quantize",
    "dequant_reduce",
    "dequant_reduce_quantize",
    "dequant_reduce_loco_quantize",
)
# Distinct static shapes one function may be compiled for (TorchDynamo's default of 8 would send
# a model with many bucket sizes back to eager, silently and slowly).
SHAPES_PER_OP = 64
# Inductor settings that keep the generated C++ at one rounding per fp32 operation, whatever
# TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG / ..._UNSAFE_MATH_OPT_FLAG say.
EXACT_FP: dict[str, str | int | bool | Callable[..., object]] = {
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
}
_P = ParamSpec("_P")
_R = TypeVar("_R")


def require_compiler() -> None:
    """RuntimeError before any work when TorchInductor would have no C++ compiler to call."""
    wanted = os.environ.get("CXX", "c++")
    if shutil.which(wanted) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        raise RuntimeError(
            f"the compiled CPU kernels need a C++ compiler for TorchInductor, and neither "
            f"$CXX ({wanted!r}), g++ nor clang++ is on PATH; install one or use the reference kernels"
        )


@functools.cache
def separate_cache_per_isa() -> str:
    """Point TorchInductor's on-disk cache at a subdirectory named after the vector ISA its code
    is generated for (`isa-avx512`, `isa-avx2`, ...), and return it.

    Why: torch 2.13 does not key that cache by the ISA. Kernels compiled under
    ATEN_CPU_CAPABILITY=avx512 and read back under avx2 returned wrong codes (0s and 1s for
    int8 values up to 127), which running the test suite under both capabilities showed; a cache
    directory shared by machines of different ISAs (a common home, a baked image) would do the
    same silently. The directory in use ($TORCHINDUCTOR_CACHE_DIR, else Inductor's default)
    keeps one subdirectory per ISA; a directory this function already chose is not nested again.
    """
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    isa = "isa-" + ("-".join(str(pick_vec_isa()).split()) or "scalar")
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if os.path.basename(os.path.normpath(base)).startswith("isa-"):
        base = os.path.dirname(os.path.normpath(base))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, isa)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _compile(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` compiled lazily, once per input shape."""
    separate_cache_per_isa()
    op = torch.compile(fn, dynamic=False, options=EXACT_FP)

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with torch._dynamo.config.patch(recompile_limit=SHAPES_PER_OP, accumulated_recompile_limit=8 * SHAPES_PER_OP):
            return op(*args, **kwargs)

    return run


@functools.cache
def arithmetic() -> reference.Arithmetic:
    """The reference's whole-block arithmetic, each function compiled."""
    return reference.Arithmetic(
        **{f.name: _compile(getattr(reference.EAGER, f.name)) for f in dataclasses.fields(reference.Arithmetic)}
    )


@functools.cache
def op(name: str) -> Callable[..., object]:
    """The public op `name` of kernels.reference, running the compiled arithmetic."""
    if name not in OPS:
        raise ValueError(f"kernels.cpu_compiled: no op named {name!r}; expected one of {', '.join(OPS)}")
    if name == "all_finite":
        return _compile(reference.all_finite)
    return functools.partial(getattr(reference, name), arith=arithmetic())


def __getattr__(name: str) -> Callable[..., object]:
    """Module attributes `quantize`, `dequantize`, ...: the same names as kernels.reference."""
    if name in OPS:
        return op(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
