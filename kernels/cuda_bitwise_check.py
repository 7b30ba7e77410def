"""Every Triton kernel on a real GPU against the torch reference on the CPU, bit for bit.

The interpreter tests (tests/test_kernels_triton.py) prove the kernels' arithmetic on CPU
tensors; only a GPU shows what its compiled code does (contracted FMAs, fast-math division,
layouts of packing, unrolled loops). This runs every op on CUDA tensors and on CPU copies
through kernels/reference.py and compares codes, scales, outputs and error buffers with
`torch.equal`: ragged lengths, block sizes from 100 to 8192, every input and output dtype,
2 and 4 parts for the reductions, and inputs with exact rounding ties, zero and below-TINY
blocks.

    python -m kernels.cuda_bitwise_check      # prints one line per case; exits 1 on a mismatch

Run by tools/gpu_check.sh; needs CUDA (and TRITON_INTERPRET unset).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from kernels import reference, triton_ops
from kernels.format import TINY_ABSMAX

BLOCKS = (100, 256, 2048, 8192)


def inputs(numel: int, block_size: int, seed: int) -> torch.Tensor:
    """Values over six decades with an all-zero block, a below-TINY block and exact ties (the
    interpreter tests use the same inputs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.logspace(-3, 3, numel)
    if numel >= 4 * block_size:
        x[:block_size] = 0.0
        x[block_size : 2 * block_size] = TINY_ABSMAX / 3
        # absmax 7 (int4 scale 1, int8 scale 7/127) and half-integer values: ties for int4
        ties = torch.arange(block_size, dtype=torch.float32) % 15 - 7.0
        ties[1::2] += 0.5
        ties[0] = 7.0
        x[2 * block_size : 3 * block_size] = ties.clamp(-7, 7)
    return x


def _same(got: object, want: object) -> str:
    """'' when equal, else what differs."""
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    for i, (g, w) in enumerate(zip(gots, wants)):
        g = g.cpu()
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"output {i}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        if not torch.equal(g, w):
            return f"output {i}: {int((g != w).sum())} of {g.numel()} values differ"
    return ""


def _case(op: str, *args: object) -> Callable[[], str]:
    """Triton's `op` on CUDA copies of the tensor arguments against the reference's `op` on host
    copies: each side gets its own (the LoCo kernels update their error feedback in place)."""

    def run() -> str:
        on_gpu = [a.clone().cuda() if isinstance(a, torch.Tensor) else a for a in args]
        on_host = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        return _same(getattr(triton_ops, op)(*on_gpu), getattr(reference, op)(*on_host))

    return run


def cases() -> list[tuple[str, Callable[[], str]]]:
    """(label, run) for every case; run returns '' or what differs."""
    out: list[tuple[str, Callable[[], str]]] = []
    for block in BLOCKS:
        numel = 5 * block - 37
        base = inputs(numel, block, seed=block)
        for bits in (4, 8):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = base.clamp(-6e4, 6e4).to(dtype)
                out.append((f"quantize int{bits} {dtype} block {block}", _case("quantize", x, bits, block)))
            codes, scales = reference.quantize(base, bits, block)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                out.append(
                    (
                        f"dequantize int{bits} -> {dtype} block {block}",
                        _case("dequantize", codes, scales, bits, block, numel, dtype),
                    )
                )
            err = inputs(-(-numel // block) * block, block, seed=block + 1) * 1e-2
            out.append((f"loco_quantize int{bits} block {block}", _case("loco_quantize", base, err, 0.8, block, bits)))
            for parts in (2, 4):
                quantized = [
                    reference.quantize(inputs(5 * block, block, seed=31 * p + bits), bits, block) for p in range(parts)
                ]
                st = (torch.stack([c for c, _ in quantized]), torch.stack([s for _, s in quantized]))
                out.append(
                    (
                        f"dequant_reduce {parts} x int{bits} -> fp32 block {block}",
                        _case("dequant_reduce", st[0], st[1], bits, block, numel),
                    )
                )
                for out_bits in (4, 8):
                    out.append(
                        (
                            f"dequant_reduce {parts} x int{bits} -> int{out_bits} block {block}",
                            _case("dequant_reduce_quantize", st[0], st[1], bits, block, out_bits),
                        )
                    )
                err = inputs(5 * block, block, seed=parts) * 1e-2
                out.append(
                    (
                        f"dequant_reduce + LoCo {parts} x int{bits} -> int4 block {block}",
                        _case("dequant_reduce_loco_quantize", st[0], st[1], bits, block, err, 0.8),
                    )
                )
    bad = inputs(4096, 256, seed=5)
    bad[1234] = float("inf")
    for label, x in (("finite", inputs(4096, 256, seed=4)), ("with inf", bad)):
        out.append((f"all_finite {label}", _case("all_finite", x)))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    failed = 0
    every = cases()
    for label, run in every:
        problem = run()
        failed += bool(problem)
        print(f"{'FAIL' if problem else 'ok  '} {label}" + (f": {problem}" if problem else ""))
    print(f"{len(every) - failed} of {len(every)} cases bit-identical on {torch.cuda.get_device_name()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
