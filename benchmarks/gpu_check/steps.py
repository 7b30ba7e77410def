"""The device check's steps, in order (`STEPS`: name, what it runs, estimated seconds, the
function): each runs its commands and judges them into an `Outcome`."""

from __future__ import annotations

import sys
from collections.abc import Callable

from benchmarks.gpu_check import elastic
from benchmarks.gpu_check.commands import Context, Outcome, run, run_sh, tail
from benchmarks.gpu_check.overheads import OVERHEAD_STEPS
from benchmarks.gpu_check.pairs import compare_on_sides
from benchmarks.gpu_check.parse import bandwidth_rows, last_json, log_lines, planned_peak_gib
from benchmarks.gpu_check.settings import (
    ENGINE_BOUND,
    ENGINE_COMMON,
    ENGINE_JOBS,
    PEER_BOUND,
    PLAN_FLAGS,
    SHAPE,
    TARGETS,
)
from benchmarks.gpu_check.two_level import JOBS as TWO_LEVEL_JOBS
from benchmarks.gpu_check.two_level import NCCL_JOB, step_two_level

PY = sys.executable


def step_kernels_bitwise(ctx: Context) -> Outcome:
    rc, text = run(ctx, "kernels-bitwise", [PY, "-m", "kernels.cuda_bitwise_check"], min(180, ctx.left()))
    fails = [line for line in text.splitlines() if line.startswith("FAIL")]
    summary = next((line for line in reversed(text.splitlines()) if "cases bit-identical" in line), "no summary")
    status = "MISMATCH" if fails else ("ok" if rc == 0 else "FAILED")
    return Outcome(status, summary, fails[:20] + ([] if rc == 0 or fails else tail(text)))


def step_kernels_bandwidth(ctx: Context) -> Outcome:
    rc, text = run(
        ctx,
        "kernels-bandwidth",
        [PY, "tools/bench_quant.py", "--devices", "cuda", "--numel", str(2**28), "--iters", "10"],
        min(150, ctx.left()),
    )
    if rc != 0:
        return Outcome("FAILED", f"bench_quant.py exited {rc}", tail(text))
    rows = bandwidth_rows(text)
    low = [op for op, share in rows if share < TARGETS["bandwidth"]]
    table = [line for line in text.splitlines() if line.startswith(("|", "Copy", "###"))]
    return Outcome(
        "ok",
        f"{len(rows)} ops, {len(rows) - len(low)} at >= 85% of copy",
        table,
        [(f"{op} >= 85% of copy", share >= TARGETS["bandwidth"], f"{share:.0%}") for op, share in rows],
    )


def step_data(ctx: Context) -> Outcome:
    rc, text = run_sh(
        ctx,
        "data",
        ["--train-iters", "1", "--log-interval", "1", "--eval-interval", "1000"],
        ranks=1,
        gpu=False,
        timeout=min(240, ctx.left()),
    ).collect()
    return Outcome(
        "ok" if rc == 0 else "FAILED",
        f"corpus, tokenizer and dataset under {ctx.out / 'data'}",
        [] if rc == 0 else tail(text),
    )


def step_engine(ctx: Context) -> Outcome:
    """Every job on CUDA ranks (gloo, sharing the GPU) and on CPU ranks at once; losses compared."""
    return compare_on_sides(ctx, "engine", ENGINE_COMMON, ENGINE_JOBS, ENGINE_BOUND)


def step_model(ctx: Context) -> Outcome:
    bench = [
        PY,
        "tools/bench_model.py",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        *SHAPE,
        "--vocab-size",
        "32000",
        "--warmup",
        "2",
        "--steps",
        "4",
        "--peak-size",
        "8192",
    ]
    rc, text = run(ctx, "model-step", bench + ["--peer", "hf"], min(300, ctx.left()))
    if rc != 0:
        return Outcome("FAILED", f"bench_model.py exited {rc}", tail(text))
    eager = last_json(text)
    rc, text = run(ctx, "model-step-compiled", bench + ["--peer", "none", "--compile"], min(300, ctx.left()))
    if rc != 0:
        return Outcome("FAILED", f"bench_model.py --compile exited {rc}", tail(text))
    compiled = last_json(text)
    peer = eager.get("peer", {})
    gaps = {
        "HF peer": abs(peer.get("first_loss", float("inf")) - eager["first_loss"]) / eager["first_loss"],
        "compiled": abs(compiled["first_loss"] - eager["first_loss"]) / eager["first_loss"],
    }
    lines = [
        "| model | tokens/s | MFU | first loss |",
        "|---|---:|---:|---:|",
        f"| megazpp | {eager['tokens_per_s']} | {eager['mfu']:.1%} | {eager['first_loss']:.5f} |",
        f"| megazpp compiled | {compiled['tokens_per_s']} | {compiled['mfu']:.1%} | {compiled['first_loss']:.5f} |",
        f"| HF LlamaForCausalLM | {peer.get('tokens_per_s')} | {peer.get('mfu', 0):.1%} | "
        f"{peer.get('first_loss', float('nan')):.5f} |",
        "",
        f"matmul peak {eager['matmul_peak_tflops']} TFLOP/s; first-loss gaps (relative): "
        + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items())
        + f" (bound {PEER_BOUND:.0e})",
    ]
    status = "ok" if all(g <= PEER_BOUND for g in gaps.values()) else "MISMATCH"
    return Outcome(
        status,
        f"MFU {eager['mfu']:.1%} eager, {compiled['mfu']:.1%} compiled, HF {peer.get('mfu', 0):.1%}",
        lines,
        [("compiled step >= 68% MFU", compiled["mfu"] >= TARGETS["mfu_compiled"], f"{compiled['mfu']:.1%}")],
    )


def step_end_to_end(ctx: Context) -> Outcome:
    rc, text = run(
        ctx,
        "bare-step",
        [
            PY,
            "tools/bench_model.py",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            *SHAPE,
            "--vocab-size",
            "2048",
            "--peer",
            "none",
            "--warmup",
            "2",
            "--steps",
            "5",
            "--peak-size",
            "8192",
        ],
        min(180, ctx.left()),
    )
    if rc != 0:
        return Outcome("FAILED", f"bare step exited {rc}", tail(text))
    bare = last_json(text)
    flags = [
        "--bf16",
        *SHAPE,
        "--global-batch-size",
        "4",
        "--train-iters",
        "30",
        "--log-interval",
        "5",
        "--eval-interval",
        "1000",
    ]
    rc, text = run_sh(ctx, "end-to-end", flags, ranks=1, gpu=True, timeout=min(300, ctx.left())).collect()
    logged = log_lines(text)
    if rc != 0 or not logged:
        return Outcome("FAILED", f"run.sh --bf16 exited {rc}", tail(text))
    rc, plan = run(
        ctx,
        "plan",
        [PY, "tools/plan.py", *PLAN_FLAGS],
        min(60, ctx.left()),
    )
    predicted = planned_peak_gib(plan) if rc == 0 else float("nan")
    steady = logged[-1]
    ratio = steady["tokens_per_s"] / bare["tokens_per_s"]
    peak_gib = steady["peak_mib"] / 1024
    off = abs(peak_gib - predicted) / predicted
    lines = [
        f"bare step: {bare['tokens_per_s']} tokens/s ({bare['mfu']:.1%} MFU); run.sh --bf16 last logged "
        f"interval: {steady['tokens_per_s']:.0f} tokens/s ({ratio:.1%} of the bare step), peak "
        f"{peak_gib:.2f} GiB against the planner's {predicted:.2f} GiB (NNN)",
        *tail(text, 8),
    ]
    return Outcome(
        "ok",
        f"{ratio:.1%} of the bare step's tokens/s; peak {peak_gib:.1f} GiB vs planned {predicted:.1f} GiB",
        lines,
        [
            ("end to end >= 95% of the bare step's tokens/s", ratio >= TARGETS["e2e_tokens"], f"{ratio:.1%}"),
            ("peak memory within 10% of the plan", off <= TARGETS["peak_memory"], f"{off:+.1%}"),
        ],
    )


Step = tuple[str, str, int, Callable[[Context], Outcome]]
_STEPS: list[Step] = [
    ("kernels-bitwise", "python -m kernels.cuda_bitwise_check", 75, step_kernels_bitwise),
    (
        "kernels-bandwidth",
        "python tools/bench_quant.py --devices cuda --numel 268435456 --iters 10",
        25,
        step_kernels_bandwidth,
    ),
    ("data", "DATA_DIR=OUT/data CUDA_VISIBLE_DEVICES= bash run.sh --train-iters 1 (builds the dataset)", 50, step_data),
    (
        "engine",
        "8 run.sh jobs at once: "
        + ", ".join(f"{n} ({r} ranks)" for n, r, _ in ENGINE_JOBS)
        + " on CUDA ranks (--distributed-backend gloo) and on CPU ranks",
        80,
        step_engine,
    ),
    (
        "two-level",
        f"{2 * len(TWO_LEVEL_JOBS)} run.sh jobs at once: "
        + ", ".join(f"{n} ({r} ranks)" for n, r, _ in TWO_LEVEL_JOBS)
        + " with DiLoCo islands on CUDA ranks (gloo) and on CPU ranks; with 2+ GPUs "
        + f"{NCCL_JOB[0]} over NCCL vs CPU ranks",
        60,
        step_two_level,
    ),
    (
        "elastic",
        "python -m megazpp.launch.lighthouse and 2 run.sh --outer-elastic islands of 1 rank "
        + f"(H {elastic.H}, {elastic.ITERS} steps) on the GPU, the same on CPU ranks: losses, syncs, checkpoints",
        45,
        elastic.step_elastic,
    ),
    (
        "model-step",
        "tools/bench_model.py --device cuda --dtype bf16 "
        + " ".join(SHAPE)
        + " --vocab-size 32000 --peer hf; again with --compile --peer none",
        140,
        step_model,
    ),
    (
        "end-to-end",
        "tools/bench_model.py (vocab 2048, --peer none); bash run.sh --bf16 "
        + " ".join(SHAPE)
        + " --train-iters 30; tools/plan.py at that shape",
        90,
        step_end_to_end,
    ),
    *OVERHEAD_STEPS,
]
# Every path a GPU user can take runs first, so the default budget (--budget-s 470, the 8 minutes
# of device time the check must fit) always covers them; the measurements follow, as the budget
# allows (kernels-geometry reads kernels-bandwidth's log, so it comes after it).
PATHS = ["kernels-bitwise", "data", "engine", "two-level", "elastic", "zero3-compiled"]
MEASUREMENTS = ["kernels-bandwidth", "kernels-geometry", "model-step", "end-to-end", "loop-overhead"]
STEPS: list[Step] = [next(s for s in _STEPS if s[0] == name) for name in PATHS + MEASUREMENTS]
assert len(STEPS) == len(_STEPS), "every step is a path or a measurement"
