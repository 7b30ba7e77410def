"""Block-wise int8/int4 quantization for ZeRO++ (qwZ, qgZ) and LoCo.

Each op is a Triton kernel (kernels/triton_ops.py) with a pure-torch twin of identical bits
(kernels/reference.py); `kernels.api` picks Triton for CUDA tensors and the twin for CPU ones (eager, or compiled by
TorchInductor: kernels/cpu_compiled.py).
Formats are described in kernels/format.py and docs/arch/kernels.md.
"""

from kernels.api import (
    CPU_KERNELS,
    KernelOps,
    all_finite,
    backend_for,
    dequant_reduce,
    dequant_reduce_loco_quantize,
    dequant_reduce_quantize,
    dequantize,
    kernel_set,
    loco_quantize,
    new_error_buffer,
    quantize,
)
from kernels.bounds import block_absmax, qgz_error_bound, quantization_error_bound
from kernels.format import DEFAULT_BLOCK_SIZE, QMAX

__all__ = [
    "CPU_KERNELS",
    "KernelOps",
    "all_finite",
    "DEFAULT_BLOCK_SIZE",
    "QMAX",
    "backend_for",
    "block_absmax",
    "dequant_reduce",
    "dequant_reduce_loco_quantize",
    "dequant_reduce_quantize",
    "dequantize",
    "kernel_set",
    "loco_quantize",
    "new_error_buffer",
    "qgz_error_bound",
    "quantization_error_bound",
    "quantize",
]
