"""Device dispatch: the Triton kernel for CUDA tensors, the torch reference for CPU tensors.

Both implementations share one signature per op (see kernels/reference.py for the semantics),
so each public function here is the reference's signature and docstring, routed by the device
of its first tensor argument.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Callable

import torch

from kernels import reference
from kernels.format import check_block_size, num_blocks
from megazpp.errors import ConfigError


def backend_for(tensor: torch.Tensor) -> ModuleType:
    """The module implementing the ops for tensors on `tensor`'s device."""
    if tensor.device.type == "cuda":
        from kernels import triton_ops  # imported lazily: CPU-only runs never initialize Triton

        return triton_ops
    if tensor.device.type == "cpu":
        return reference
    raise ConfigError(
        f"quantization kernels run on cuda (Triton) or cpu (torch reference) tensors, not {tensor.device}"
    )


def _dispatched(op: Callable) -> Callable:
    first = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def run(*args, **kwargs):
        tensor = args[0] if args else kwargs[first]
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{op.__name__}: {first} must be a torch.Tensor, got {type(tensor).__name__}")
        return getattr(backend_for(tensor), op.__name__)(*args, **kwargs)

    return run


quantize = _dispatched(reference.quantize)
dequantize = _dispatched(reference.dequantize)
loco_quantize = _dispatched(reference.loco_quantize)
dequant_reduce = _dispatched(reference.dequant_reduce)
dequant_reduce_quantize = _dispatched(reference.dequant_reduce_quantize)
dequant_reduce_loco_quantize = _dispatched(reference.dequant_reduce_loco_quantize)


def new_error_buffer(
    numel: int, block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero LoCo error buffer (int8 codes, fp32 scales) for a `numel`-value tensor.

    All-zero codes with zero scales decode to exactly 0, which is also what a reset
    (every reset_T steps) writes back.
    """
    check_block_size(block_size)
    blocks = num_blocks(numel, block_size)
    return (
        torch.zeros(blocks * block_size, dtype=torch.int8, device=device),
        torch.zeros(blocks, dtype=torch.float32, device=device),
    )
