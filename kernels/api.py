"""Device dispatch: the Triton kernel for CUDA tensors, the torch reference for CPU tensors.

All implementations share one signature per op (see kernels/reference.py for the semantics),
so each public function here is the reference's signature and docstring, routed by the device
of its first tensor argument. On CPU the reference runs eagerly by default; `kernel_set
("compiled")` routes CPU tensors to the same source compiled by TorchInductor
(kernels/cpu_compiled.py), which an engine picks from `zero.cpu_quant_kernels`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import ParamSpec, Protocol, TypeVar, cast

import torch

from kernels import reference
from kernels.format import check_block_size, num_blocks

CPU_KERNELS = ("reference", "compiled")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def check_cpu_kernels(cpu: str) -> str:
    """Raise ValueError unless `cpu` names a CPU implementation of the ops (CPU_KERNELS)."""
    if cpu not in CPU_KERNELS:
        raise ValueError(f"CPU kernels {cpu!r}: expected one of {', '.join(map(repr, CPU_KERNELS))}")
    return cpu


def backend_for(tensor: torch.Tensor, cpu: str = "reference") -> ModuleType:
    """The module implementing the ops for tensors on `tensor`'s device (`cpu`: which CPU one)."""
    if tensor.device.type == "cuda":
        from kernels import triton_ops  # imported lazily: CPU-only runs never initialize Triton

        return triton_ops
    if tensor.device.type == "cpu":
        if check_cpu_kernels(cpu) == "compiled":
            from kernels import cpu_compiled  # imported lazily: torch.compile is slow to import

            return cpu_compiled
        return reference
    raise ValueError(f"quantization kernels run on cuda (Triton) or cpu (torch reference) tensors, not {tensor.device}")


def _dispatched(op: Callable[_P, _R], cpu: str) -> Callable[_P, _R]:
    first = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        tensor = args[0] if args else kwargs[first]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{op.__name__}: {first} must be a torch.Tensor, got {type(tensor).__name__}")
        impl: Callable[_P, _R] = getattr(backend_for(tensor, cpu), op.__name__)
        return impl(*args, **kwargs)

    return run


class KernelOps(Protocol):
    """The ops every implementation provides (kernels/reference.py, triton_ops.py,
    cpu_compiled.py), with the reference's parameters: the type of `kernel_set(...)`, so an
    editor follows `ops.quantize` to a signature and the reference documents what it does."""

    def all_finite(self, x: torch.Tensor) -> torch.Tensor: ...

    def quantize(self, x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dequantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bits: int,
        block_size: int,
        numel: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor: ...

    def loco_quantize(
        self, grad: torch.Tensor, err: torch.Tensor, err_beta: float, block_size: int, bits: int = 4
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def dequant_reduce(
        self, codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, numel: int | None = None
    ) -> torch.Tensor: ...

    def dequant_reduce_quantize(
        self, codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, out_bits: int = 4
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dequant_reduce_loco_quantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bits: int,
        block_size: int,
        err: torch.Tensor,
        err_beta: float,
        out_bits: int = 4,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


_OPS = (
    reference.all_finite,
    reference.quantize,
    reference.dequantize,
    reference.loco_quantize,
    reference.dequant_reduce,
    reference.dequant_reduce_quantize,
    reference.dequant_reduce_loco_quantize,
)


@functools.cache
def kernel_set(cpu: str = "reference") -> KernelOps:
    """The ops as attributes (`.quantize`, `.all_finite`, ...), CPU tensors going to the `cpu`
    implementation."""
    check_cpu_kernels(cpu)
    if cpu == "compiled":
        from kernels import cpu_compiled

        cpu_compiled.require_compiler()
    return cast(KernelOps, SimpleNamespace(**{op.__name__: _dispatched(op, cpu) for op in _OPS}))


_DEFAULT = kernel_set("reference")
all_finite = _DEFAULT.all_finite
quantize = _DEFAULT.quantize
dequantize = _DEFAULT.dequantize
loco_quantize = _DEFAULT.loco_quantize
dequant_reduce = _DEFAULT.dequant_reduce
dequant_reduce_quantize = _DEFAULT.dequant_reduce_quantize
dequant_reduce_loco_quantize = _DEFAULT.dequant_reduce_loco_quantize


def new_error_buffer(numel: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero LoCo error buffer (fp32, whole blocks) for a `numel`-value tensor; zeros are also
    what a reset (every reset_T steps) writes back."""
    check_block_size(block_size)
    return torch.zeros(num_blocks(numel, block_size) * block_size, dtype=torch.float32, device=device)
