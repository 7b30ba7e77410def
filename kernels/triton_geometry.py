"""Launch geometry of the Triton kernels (elements per program x warps), tuned per GPU and size.

Why tuned: on an H200 the best geometry was worth about ten points of copy bandwidth for the
memory-bound ops and differed between them (issue 40: 2048 elements and 2 warps for int8 and
int4 quantize, 2048-8192 elements for the reduce into fp32, against the fixed 4096 x 4 used
before), and what suits one GPU or one size need not suit another. So each kernel variant
(its compile-time constants) is wrapped in Triton's autotuner over `CANDIDATES`, keyed by the
block count (and Triton adds the tensors' dtypes): the first launch of a size times every
candidate on the device and keeps the fastest for the rest of the process.

Why the bits cannot change: blocks are independent and each is handled whole by one program
(a program's rows are whole blocks), so which program computes a block, and how many warps
it uses, changes nothing in its arithmetic (tests/test_kernels_triton.py runs every candidate
against the reference under the interpreter). Timing a LoCo variant runs it several times,
so its error buffer is restored by the autotuner after each trial (`restore_value`).

Under Triton's interpreter (TRITON_INTERPRET=1, the tests) nothing is timed: a launch uses the
geometry it is given, else `default_geometry`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.testing
from triton.runtime.interpreter import InterpretedFunction

# Timing budget per candidate, in ms (Triton's defaults, 25 and 100, would spend seconds per
# bucket size at start-up across ~15 candidates and a few ops).
_WARMUP_MS, _REP_MS = 5, 20


@dataclass(frozen=True)
class Geometry:
    """Elements per program (rounded down to whole blocks, at least one) and warps per program."""

    elements: int
    warps: int

    def rows(self, block_size: int) -> int:
        return max(1, self.elements // int(triton.next_power_of_2(block_size)))

    def launch_options(self, block_size: int) -> dict[str, int | bool]:
        """Constexprs and launch options of one launch (fp fusion off: one rounding per op)."""
        return dict(
            BLOCK=block_size,
            BLOCK_P2=triton.next_power_of_2(block_size),
            ROWS=self.rows(block_size),
            num_warps=self.warps,
            enable_fp_fusion=False,
        )


CANDIDATES = tuple(Geometry(e, w) for e in (1024, 2048, 4096, 8192, 16384) for w in (2, 4, 8))


def default_geometry(block_size: int) -> Geometry:
    """The fixed geometry used before tuning: 4096 elements and 4 warps, 8 warps for one block
    wider than that (kept for the interpreter and the PTX check)."""
    return Geometry(4096, 4 if triton.next_power_of_2(block_size) <= 4096 else 8)


# One autotuner per kernel variant: (kernel, block size, constants, restored arguments).
_TunerKey = tuple[triton.JITFunction, int, tuple[tuple[str, object], ...], tuple[str, ...]]
_TUNERS: dict[_TunerKey, triton.runtime.Autotuner] = {}


def _tuner(
    kernel: triton.JITFunction, block_size: int, consts: tuple[tuple[str, object], ...], restore: tuple[str, ...]
) -> triton.runtime.Autotuner:
    """The variant's autotuner (built on first use), over the candidates distinct for this
    block size (for wide blocks several candidates mean the same single-block rows)."""
    key: _TunerKey = (kernel, block_size, consts, restore)
    if key not in _TUNERS:
        configs = {(g.rows(block_size), g.warps) for g in CANDIDATES}
        _TUNERS[key] = triton.autotune(
            configs=[triton.Config({"ROWS": rows}, num_warps=warps) for rows, warps in sorted(configs)],
            key=["blocks"],
            restore_value=list(restore),
            do_bench=functools.partial(triton.testing.do_bench, warmup=_WARMUP_MS, rep=_REP_MS),
        )(kernel)
    return _TUNERS[key]


def launch(
    kernel: triton.JITFunction,
    blocks: int,
    block_size: int,
    *args: object,
    geometry: Geometry | None = None,
    restore: tuple[str, ...] = (),
    **consts: object,
) -> None:
    """Run `kernel` over `blocks` blocks: with `geometry` if given (or under the interpreter,
    its default), else tuned on this GPU for this variant and size. `restore` names the
    pointer arguments the kernel updates in place (reset between timing trials)."""
    options = (geometry or default_geometry(block_size)).launch_options(block_size)
    if geometry is not None or isinstance(kernel, InterpretedFunction):
        kernel[(triton.cdiv(blocks, options["ROWS"]),)](*args, **options, **consts)
        return
    del options["ROWS"], options["num_warps"]
    tuner = _tuner(kernel, block_size, tuple(sorted(consts.items())), restore)
    tuner[lambda meta: (triton.cdiv(blocks, meta["ROWS"]),)](*args, **options, **consts)


def tuned() -> list[tuple[str, dict[str, object], int, Geometry]]:
    """(kernel name, constants, block count, geometry chosen) of every size tuned so far in
    this process, for tools/gpu_check.sh's report."""
    return [
        (
            kernel.__name__,
            dict(consts),
            int(size[0]),
            Geometry(config.kwargs["ROWS"] * triton.next_power_of_2(block_size), config.num_warps),
        )
        for (kernel, block_size, consts, _), tuner in _TUNERS.items()
        for size, config in tuner.cache.items()
    ]
