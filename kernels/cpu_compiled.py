"""The torch reference ops compiled by TorchInductor into fused C++ loops, for CPU ranks.

Why: eager torch runs every line of kernels/reference.py as its own pass over memory (a
quantize is about ten passes), so on CPU ranks ZeRO++ spent more host time quantizing than
it saved on the link. Compiling the very same source fuses those passes into one or two loops;
the arithmetic is unchanged (no reciprocal for a division, sums in the same order), so the
codes and scales are the reference's bit for bit, which tests/test_kernels_cpu_compiled.py
checks. Shapes are compiled as dynamic, so one compilation serves every bucket size.

Selected by `zero.cpu_quant_kernels: compiled`; needs a C++ compiler on the ranks' machines
(TorchInductor's CPU backend calls it once per op, cached on disk afterwards).
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Callable

import torch

from kernels import reference
from megazpp.errors import ConfigError

OPS = ("quantize", "dequantize", "loco_quantize", "dequant_reduce", "dequant_reduce_quantize",
       "dequant_reduce_loco_quantize")


def require_compiler() -> None:
    """ConfigError before any work when TorchInductor would have no C++ compiler to call."""
    wanted = os.environ.get("CXX", "c++")
    if shutil.which(wanted) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        raise ConfigError(f"zero.cpu_quant_kernels = 'compiled' needs a C++ compiler for TorchInductor, "
                          f"and neither $CXX ({wanted!r}), g++ nor clang++ is on PATH; install one or "
                          f"use 'reference'")


@functools.cache
def compiled(name: str) -> Callable:
    """The reference op `name`, compiled lazily at its first call."""
    if name not in OPS:
        raise ConfigError(f"kernels.cpu_compiled: no op named {name!r}; expected one of {', '.join(OPS)}")
    return torch.compile(getattr(reference, name), dynamic=True)


def __getattr__(name: str) -> Callable:
    """Module attributes `quantize`, `dequantize`, ...: the same names as kernels.reference."""
    if name in OPS:
        return compiled(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
