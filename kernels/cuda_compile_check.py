"""Compile every Triton kernel variant to PTX for a CUDA target, without a GPU.

The interpreter tests prove the kernels' arithmetic; they cannot see code that only a real
compilation exercises (layouts of reshape/split/join, dtype-dependent branches, bitcasts). This
check compiles each launch variant ahead of time with Triton's bundled ptxas and inspects the
PTX for the properties the design relies on: no fused multiply-add (the bit-identity with the
reference assumes one rounding per operation), 16-byte global loads (the kernels are
memory-bound; scalar loads would cap them far below copy bandwidth), and in the k-way
reductions every part's loads in straight-line code (the unrolled parts loop).

    python -m kernels.cuda_compile_check            # exits 1 and names the variant on failure

TRITON_INTERPRET must be unset: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import re
import struct
import sys
from typing import TypeAlias

import triton
from triton.backends.compiler import GPUTarget

from kernels import triton_ops
from kernels.format import QMAX, ROUND_MAGIC
from kernels.triton_geometry import CANDIDATES, Geometry, default_geometry

TARGET = GPUTarget("cuda", 90, 32)  # H100

_REDUCE_ARGS = {
    "in_codes_ptr": "*u8",
    "in_scales_ptr": "*fp32",
    "codes_stride": "i32",
    "scales_stride": "i32",
    "out_ptr": "*fp32",
    "out_codes_ptr": "*u8",
    "out_scales_ptr": "*fp32",
    "err_ptr": "*fp32",
    "numel": "i32",
    "blocks": "i32",
    "beta": "fp32",
    "keep": "fp32",
}


_LAUNCH_OPTIONS = ("num_warps", "enable_fp_fusion")
# +ROUND_MAGIC and -ROUND_MAGIC as PTX writes fp32 immediates (0f + IEEE bits, upper case).
_MAGIC_PTX = tuple(f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}" for v in (ROUND_MAGIC, -ROUND_MAGIC))

# a variant's constexprs and launch options, by name (`Geometry.launch_options` and the kernel's own)
Constexprs: TypeAlias = dict[str, int | bool]


def _tile(block_size: int, geometry: Geometry | None = None) -> Constexprs:
    """Constexprs and launch options for this block size, at the default geometry or `geometry`."""
    return (geometry or default_geometry(block_size)).launch_options(block_size)


def variants() -> list[tuple[str, object, dict[str, str], Constexprs]]:
    """(label, kernel, runtime argument types, constexprs) for every launch the ops make."""
    quant = {"codes_ptr": "*u8", "scales_ptr": "*fp32", "numel": "i32", "blocks": "i32"}
    out = []
    for src in ("fp32", "bf16", "fp16"):
        for bits, code in ((4, "u8"), (8, "i8")):
            block = 256 if bits == 4 else 2048
            args = {"x_ptr": f"*{src}", **quant, "codes_ptr": f"*{code}"}
            consts = {**_tile(block), "BITS": bits, "QMAX": QMAX[bits]}
            out.append((f"quantize {src} int{bits}", triton_ops._quantize_kernel, args, consts))
            loco = {
                "x_ptr": f"*{src}",
                "err_ptr": "*fp32",
                **quant,
                "codes_ptr": f"*{code}",
                "beta": "fp32",
                "keep": "fp32",
            }
            out.append((f"loco_quantize {src} int{bits}", triton_ops._loco_quantize_kernel, loco, consts))
    for dst in ("fp32", "bf16", "fp16"):
        for bits, code in ((4, "u8"), (8, "i8")):
            args = {
                "codes_ptr": f"*{code}",
                "scales_ptr": "*fp32",
                "out_ptr": f"*{dst}",
                "numel": "i32",
                "blocks": "i32",
            }
            out.append(
                (f"dequantize int{bits} -> {dst}", triton_ops._dequantize_kernel, args, {**_tile(256), "BITS": bits})
            )
    for bits, out_bits, with_loco in (
        (4, 0, False),
        (4, 4, False),
        (4, 8, False),
        (4, 4, True),
        (8, 0, False),
        (8, 4, False),
        (8, 4, True),
    ):
        consts = {
            **_tile(256),
            "PARTS": 4,
            "BITS": bits,
            "OUT_BITS": out_bits,
            "OUT_QMAX": QMAX.get(out_bits, 0),
            "LOCO": with_loco,
        }
        label = (
            f"dequant_reduce 4 x int{bits} -> {'fp32' if not out_bits else f'int{out_bits}'}"
            f"{' + LoCo' if with_loco else ''}"
        )
        args = {**_REDUCE_ARGS, "in_codes_ptr": "*u8" if bits == 4 else "*i8"}
        out.append((label, triton_ops._dequant_reduce_kernel, args, consts))
    # The extremes of the tuned geometries (kernels/triton_geometry.py): the fewest elements and
    # warps, and the most, each still with vector loads and without FMAs.
    for geometry in (
        min(CANDIDATES, key=lambda g: (g.elements, g.warps)),
        max(CANDIDATES, key=lambda g: (g.elements, g.warps)),
    ):
        out.append(
            (
                f"quantize bf16 int8, {geometry.elements} elements x {geometry.warps} warps",
                triton_ops._quantize_kernel,
                {"x_ptr": "*bf16", **quant, "codes_ptr": "*i8"},
                {**_tile(2048, geometry), "BITS": 8, "QMAX": 127},
            )
        )
    # A block wider than one tile: one row per program, eight warps.
    out.append(
        (
            "quantize fp32 int4, block 8192",
            triton_ops._quantize_kernel,
            {"x_ptr": "*fp32", **quant},
            {**_tile(8192), "BITS": 4, "QMAX": 7},
        )
    )
    return out


def compile_ptx(kernel: object, args: dict[str, str], consts: Constexprs) -> str:
    """PTX of one variant, with pointers and ints specialized as 16-divisible like a real launch."""
    options = {name: consts[name] for name in _LAUNCH_OPTIONS}
    consts = {name: value for name, value in consts.items() if name not in _LAUNCH_OPTIONS}
    signature = {**args, **{name: "constexpr" for name in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(args.values()) if t.startswith("*") or t == "i32"}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    ptx: str = triton.compile(source, target=TARGET, options=options).asm["ptx"]
    return ptx


def problems(ptx: str, consts: Constexprs | None = None) -> list[str]:
    """What is wrong with one variant's PTX (empty when nothing is)."""
    found = []
    parts = (consts or {}).get("PARTS")
    if parts and len(re.findall(r"\bld\.global", ptx)) < 2 * parts:
        found.append(f"fewer than 2 x {parts} global loads: the parts loop is not unrolled")
    if re.search(r"\bfma\.", ptx):
        found.append("contains fma (fp fusion must stay off for bit-identity)")
    if not re.search(r"\bld\.global(\.\w+)*\.v[24]\.", ptx):
        found.append("has no vectorized global load")
    quantizes = "QMAX" in (consts or {}) or (consts or {}).get("OUT_BITS")
    if quantizes and not all(re.search(rf"\badd\.rn\.f32\s[^;]*, {c};", ptx) for c in _MAGIC_PTX):
        found.append("lacks the rounding's add.rn.f32 of +-ROUND_MAGIC (folded or fused away)")
    return found


def main() -> int:
    failed = 0
    for label, kernel, args, consts in variants():
        issues = problems(compile_ptx(kernel, args, consts), consts)
        print(f"{'FAIL' if issues else 'ok  '} {label}" + (": " + "; ".join(issues) if issues else ""))
        failed += bool(issues)
    print(f"{len(variants()) - failed} of {len(variants())} variants compiled cleanly for {TARGET}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
