"""Issue 40's device steps: the kernels' tuned launch geometry, ZeRO-3 with --compile against
eager on 2 ranks sharing the GPU, and the training loop's time split into phases.

Their own module so the step list in steps.py grows by one line (`OVERHEAD_STEPS`)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from benchmarks.gpu_check.commands import Context, Outcome, run, run_sh, tail
from benchmarks.gpu_check.parse import log_lines, tb_losses
from benchmarks.gpu_check.settings import ENGINE_BOUND, ENGINE_COMMON, SHAPE

PY = sys.executable
# ZeRO-3 eager vs compiled: long enough that the last logged interval is past compilation
COMPILED_ZERO3 = ["--zero-stage", "3", "--distributed-backend", "gloo", "--train-iters", "12", "--log-interval", "4"]
# Compiled layers reorder reductions (tests/test_model_compile.py bounds 1e-4 over 4 steps on
# CPU, measured 5e-7): the same relative bound as ZeRO-3's CUDA-vs-CPU engine job.
COMPILE_BOUND = ENGINE_BOUND["zero3"]
RUN_SH_CONFIG = "configs/llama_tiny.yaml"  # run.sh's default $CONFIG, which it passes first


def geometry_rows(text: str) -> list[list[str]]:
    """The tuned-geometry table bench_quant.py prints after its CUDA section: the cells of
    each row (kernel, constants, blocks, elements per program, warps)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| _") and len(cells) == 5 and cells[2].isdigit():
            rows.append(cells)
    return rows


def step_kernels_geometry(ctx: Context) -> Outcome:
    """Read the geometry the autotuner chose in the kernels-bandwidth step's run (no new run)."""
    log = ctx.out / "logs" / "kernels-bandwidth.log"
    if not log.exists():
        return Outcome("FAILED", "no kernels-bandwidth log to read the tuned geometry from")
    rows = geometry_rows(log.read_text())
    lines = ["| kernel | constants | blocks | elements per program | warps |", "|---|---|---:|---:|---:|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    status = "ok" if rows else "FAILED"
    return Outcome(status, f"{len(rows)} kernel variants and sizes tuned", lines)


def step_zero3_compiled(ctx: Context) -> Outcome:
    """ZeRO-3 eager, then with --compile, on 2 ranks sharing the GPU: losses and tokens/s."""
    results = {}
    for label, extra in (("eager", []), ("compiled", ["--compile"])):
        name = f"zero3-{label}"
        rc, text = run_sh(
            ctx, name, ENGINE_COMMON + COMPILED_ZERO3 + extra, ranks=2, gpu=True, timeout=min(240, ctx.left())
        ).collect()
        if rc != 0 or not log_lines(text):
            return Outcome("FAILED", f"ZeRO-3 {label} exited {rc}", tail(text))
        results[label] = (tb_losses(ctx.out / "tb" / name), log_lines(text)[-1]["tokens_per_s"])
    (eager, eager_tps), (compiled, compiled_tps) = results["eager"], results["compiled"]
    gap = (
        max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
        if len(compiled) == len(eager) and eager
        else float("inf")
    )
    lines = [
        f"eager losses: {', '.join(f'{x:.6f}' for x in eager)}",
        f"compiled losses: {', '.join(f'{x:.6f}' for x in compiled)}",
        f"max relative gap {gap:.2e} (bound {COMPILE_BOUND:.0e})",
        f"tokens/s of the last logged interval: eager {eager_tps:.0f}, compiled {compiled_tps:.0f}",
    ]
    return Outcome(
        "ok" if gap <= COMPILE_BOUND else "MISMATCH",
        f"gap {gap:.1e}; compiled {compiled_tps / eager_tps:.2f}x eager's tokens/s",
        lines,
        [("ZeRO-3 + --compile faster than eager", compiled_tps > eager_tps, f"{compiled_tps / eager_tps:.2f}x")],
    )


def step_loop_overhead(ctx: Context) -> Outcome:
    """tools/profile_loop.py on the end-to-end step's bf16 job (run.sh's config and data, one
    rank): the loop's time per phase."""
    data = ctx.out / "data"
    flags = [
        "--config",
        RUN_SH_CONFIG,
        "--data-path",
        str(data / "corpus_text_document"),
        "--tokenizer-model",
        str(data / "tokenizer.model"),
        "--bf16",
        *SHAPE,
        "--vocab-size",
        "2048",
        "--global-batch-size",
        "4",
        "--train-iters",
        "20",
        "--log-interval",
        "5",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "0",
    ]
    rc, text = run(ctx, "loop-overhead", [PY, "tools/profile_loop.py", "--", *flags], min(240, ctx.left()))
    table = [line for line in text.splitlines() if line.startswith("|")]
    if rc != 0 or not table:
        return Outcome("FAILED", f"profile_loop.py exited {rc}", tail(text))
    shares = {cells[0]: cells[2] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in table)}
    beyond = [f"{k} {v}" for k, v in shares.items() if re.match(r"(data|logging|numerics|loss|stop|rest)", k)]
    return Outcome("ok", "beyond the step: " + ", ".join(beyond), table)


OVERHEAD_STEPS: list[tuple[str, str, int, Callable[[Context], Outcome]]] = [
    (
        "kernels-geometry",
        "the geometry Triton's autotuner chose in kernels-bandwidth (read from its log)",
        1,
        step_kernels_geometry,
    ),
    (
        "zero3-compiled",
        "2 run.sh jobs on 2 ranks sharing the GPU (gloo): --zero-stage 3, then with --compile",
        150,
        step_zero3_compiled,
    ),
    (
        "loop-overhead",
        "tools/profile_loop.py: run.sh --bf16's job (vocab 2048, 20 steps) under cProfile, time per phase",
        60,
        step_loop_overhead,
    ),
]
