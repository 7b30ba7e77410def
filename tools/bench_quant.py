"""Throughput of the quantization kernels, as bytes moved per second, in a Markdown table.

Every op runs on CPU through the torch reference (eager, and compiled by TorchInductor:
kernels/cpu_compiled.py) and, when a GPU is present, on CUDA through the Triton kernels.
Bytes moved = bytes of every input tensor + bytes of every output tensor (an
error buffer updated in place counts once as input and once as output). Each device's copy
bandwidth is measured in the same run (a clone of an fp32 tensor of the benchmark's size, read +
write), and every op is reported as a percentage of it: these ops stream memory once, so the
copy is their ceiling.

    python tools/bench_quant.py                      # CPU reference, plus Triton if CUDA is present
    python tools/bench_quant.py --numel 268435456    # bigger GPU problem
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels
from megazpp.cli import run_tool


@dataclass
class Case:
    """One op on one problem: what it reads, and how to run it (returns what it writes)."""

    name: str
    inputs: tuple[torch.Tensor, ...]
    run: Callable[[], object]


def _tensors(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    raise TypeError(f"a benchmarked op returned {type(result).__name__}, not tensors")


def _cases(numel: int, parts: int, int4_block: int, int8_block: int, device: str, ops: kernels.KernelOps) -> list[Case]:
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(numel, device=device, generator=gen)
    weight = grad.to(torch.bfloat16)
    w8 = kernels.quantize(weight, 8, int8_block)
    g4 = kernels.quantize(grad, 4, int4_block)
    err = kernels.new_error_buffer(numel, int4_block, device)  # LoCo's fp32 buffer, whole blocks
    err[:numel] = grad * 0.01
    part_numel = numel // parts // int4_block * int4_block
    chunks = [kernels.quantize(grad[i * part_numel : (i + 1) * part_numel], 4, int4_block) for i in range(parts)]
    codes = torch.stack([c for c, _ in chunks])
    scales = torch.stack([s for _, s in chunks])
    part_err = grad[:part_numel] * 0.01
    k = f"{parts} x {part_numel}"
    return [
        Case("quantize int8 (qwZ, bf16 in)", (weight,), lambda: ops.quantize(weight, 8, int8_block)),
        Case(
            "dequantize int8 -> bf16 (qwZ)",
            w8,
            lambda: ops.dequantize(*w8, 8, int8_block, numel, torch.bfloat16),
        ),
        Case("quantize int4 (qgZ, fp32 in)", (grad,), lambda: ops.quantize(grad, 4, int4_block)),
        Case("dequantize int4 -> fp32", g4, lambda: ops.dequantize(*g4, 4, int4_block, numel)),
        Case(
            "LoCo quantize int4 + fp32 error",
            (grad, err),
            lambda: ops.loco_quantize(grad, err, 0.8, int4_block),
        ),
        Case(
            f"dequant-reduce int4 {k} -> fp32",
            (codes, scales),
            lambda: ops.dequant_reduce(codes, scales, 4, int4_block),
        ),
        Case(
            f"dequant-reduce int4 {k} -> int4",
            (codes, scales),
            lambda: ops.dequant_reduce_quantize(codes, scales, 4, int4_block, 4),
        ),
        Case(
            f"dequant-reduce + LoCo int4 {k} -> int4",
            (codes, scales, part_err),
            lambda: ops.dequant_reduce_loco_quantize(codes, scales, 4, int4_block, part_err, 0.8),
        ),
    ]


def _time(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median seconds per call (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _device_name(device: str, cpu_kernels: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (Triton kernels)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    how = "torch reference, compiled by TorchInductor" if cpu_kernels == "compiled" else "torch reference, eager"
    return f"{cpu}, {torch.get_num_threads()} threads ({how})"


def bench_device(device: str, numel: int, args: argparse.Namespace, cpu_kernels: str = "reference") -> str:
    """The Markdown section for one device (and, on CPU, one of `kernels.CPU_KERNELS`)."""
    src = torch.randn(numel, device=device)
    copy_s = _time(src.clone, device, args.warmup, args.iters)
    copy_bw = 2 * src.nbytes / copy_s
    lines = [
        f"### {_device_name(device, cpu_kernels)}",
        "",
        f"Copy bandwidth (clone of {numel} fp32, read + write): {copy_bw / 1e9:.1f} GB/s; "
        f"int4 block {args.int4_block}, int8 block {args.int8_block}.",
        "",
        "| op | bytes moved | time (us) | GB/s | % of copy |",
        "|---|---:|---:|---:|---:|",
    ]
    ops = kernels.kernel_set(cpu_kernels)
    for case in _cases(numel, args.parts, args.int4_block, args.int8_block, device, ops):
        moved = sum(t.nbytes for t in case.inputs) + sum(t.nbytes for t in _tensors(case.run()))
        seconds = _time(case.run, device, args.warmup, args.iters)
        lines.append(
            f"| {case.name} | {moved:,} | {seconds * 1e6:,.1f} | {moved / seconds / 1e9:,.1f} | "
            f"{100 * moved / seconds / copy_bw:.0f}% |"
        )
    if device == "cuda":  # what Triton's autotuner chose for each kernel variant and size
        from kernels.triton_geometry import tuned

        lines += ["", "| kernel | constants | blocks | elements per program | warps |", "|---|---|---:|---:|---:|"]
        for kernel, consts, blocks, geometry in tuned():
            shown = " ".join(f"{k}={v}" for k, v in consts.items())
            lines.append(f"| {kernel} | {shown} | {blocks} | {geometry.elements} | {geometry.warps} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="elements per GPU problem")
    parser.add_argument("--cpu-numel", type=int, default=4 * 2**20, help="elements per CPU problem")
    parser.add_argument("--parts", type=int, default=4, help="chunks summed by dequant-reduce (ranks per node)")
    parser.add_argument("--int4-block", type=int, default=kernels.DEFAULT_BLOCK_SIZE[4])
    parser.add_argument("--int8-block", type=int, default=kernels.DEFAULT_BLOCK_SIZE[8])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--devices", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--cpu-kernels",
        default=",".join(kernels.CPU_KERNELS),
        help="comma-separated CPU implementations to measure (kernels.CPU_KERNELS)",
    )
    args = parser.parse_args(argv)
    devices = {"auto": ["cpu"] + (["cuda"] if torch.cuda.is_available() else []), "cpu": ["cpu"], "cuda": ["cuda"]}
    if args.devices == "cuda" and not torch.cuda.is_available():
        parser.error("--devices cuda: no CUDA device is available")
    print("## Quantization kernel throughput\n")
    cpu_kernels = [kernels.api.check_cpu_kernels(c) for c in args.cpu_kernels.split(",") if c]
    for device in devices[args.devices]:
        for flavour in cpu_kernels if device == "cpu" else ["reference"]:
            print(bench_device(device, args.cpu_numel if device == "cpu" else args.numel, args, flavour) + "\n")


if __name__ == "__main__":
    run_tool(main)
