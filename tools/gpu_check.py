"""One prepared device check: everything issue 30 asks of a GPU, in one run, with a report.

GPU machines are lent for minutes, so what needs one is prepared here and run as one command
(`tools/gpu_check.sh`, which installs a carried zstandard wheel first). Steps, in order:

1. kernels-bitwise   every Triton op on CUDA == the CPU reference, bit for bit
2. kernels-bandwidth bench_quant.py --devices cuda at 2^28 elements, each op vs copy bandwidth
3. data              run.sh's corpus, tokenizer and dataset under OUT/data (one CPU iteration)
4. engine            ZeRO-1, ZeRO-3, PaRO IGG, ZeRO-3 + qwZ + hpZ + qgZ + LoCo on 2-4 gloo
                     ranks sharing the GPU, each against the same job on CPU ranks (losses)
5. two-level         DiLoCo islands: int4 with error feedback (ZeRO-2), streaming with overlap
                     (ZeRO-3, bf16), both under ZeRO++, on 4 gloo ranks sharing the GPU, each
                     against CPU ranks; with 2+ GPUs one int4 job over NCCL, one rank per GPU
6. elastic           two-level with --outer-elastic: a lighthouse (python -m megazpp.launch.lighthouse)
                     and 2 islands, each its own run.sh job of 1 rank, on the GPU and on CPU ranks:
                     losses against CPU, the syncs met, the islands' checkpoints equal bit for bit
7. model-step        bench_model.py bf16 at Llama 24 x 2048 (GQA 16/8, seq 2048, mbs 4, vocab
                     32000) beside Hugging Face's Llama, then compiled (--compile)
8. end-to-end        run.sh --bf16 at the same shape (vocab 2048) against the bare step's
                     tokens/s (bench_model at vocab 2048) and the planner's predicted peak memory
9. kernels-geometry  the launch geometry Triton's autotuner chose in step 2, per kernel and size
10. zero3-compiled   ZeRO-3 on 2 gloo ranks sharing the GPU, eager then --compile: losses, tokens/s
11. loop-overhead    tools/profile_loop.py on step 7's job: the loop's time per phase (issue 40)

A mismatch (a kernel bit, losses off the CPU job or the HF peer by more than the bound, a
failed or timed-out command) makes the exit status 1; a step skipped because the time budget
(--budget-s) ran out makes it 3; targets (85% of copy bandwidth, 68% MFU compiled, 95% of the
bare step's tokens/s, peak memory within 10% of the plan) are reported, met or not, and do not
change the status: they are measurements. OUT/report.md holds the summary and every number,
OUT/logs/ each command's output. `--dry-run` prints the plan, checks that every engine,
two-level and elastic job's flags form a valid config, and needs no GPU. The report names the commit when
the project root is a git checkout's top level, and always gives a fingerprint of the source
files (`benchmarks/gpu_check/provenance.py`), so a copied tree's report matches a commit.

This file is the command line (the plan, the dry run, the loop over the steps); the settings and
bounds, running commands, parsing their output, the steps and the report are the modules of
`benchmarks/gpu_check/`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)

from benchmarks.gpu_check import elastic, two_level
from benchmarks.gpu_check.commands import Context, Outcome
from benchmarks.gpu_check.overheads import COMPILED_ZERO3, RUN_SH_CONFIG
from benchmarks.gpu_check.pairs import check_jobs
from benchmarks.gpu_check.provenance import describe
from benchmarks.gpu_check.report import write_report
from benchmarks.gpu_check.settings import ENGINE_COMMON, ENGINE_JOBS
from benchmarks.gpu_check.steps import PATHS, STEPS
from megazpp.launch.lighthouse import parse_args as parse_lighthouse

ROOT = Path(__file__).resolve().parents[1]


def dry_run() -> int:
    """Print the plan and check every engine, two-level and elastic job's flags form a valid
    config (no GPU needed)."""
    print("tools/gpu_check.sh plan (estimated seconds on one H100 / H200; budget --budget-s):")
    for name, what, seconds, _ in STEPS:
        print(f"  {name:18s} ~{seconds:>4d} s  {what}")
    paths = sum(s for name, _, s, _ in STEPS if name in PATHS)
    print(f"  total ~{sum(s for _, _, s, _ in STEPS)} s; the paths ({', '.join(PATHS)}) first: ~{paths} s")
    for line in check_jobs(ROOT, ENGINE_COMMON, ENGINE_JOBS):
        print(f"  engine job {line}")
    for line in check_jobs(ROOT, two_level.COMMON, two_level.JOBS):
        print(f"  two-level job {line}")
    for line in check_jobs(ROOT, two_level.COMMON, [two_level.NCCL_JOB], two_level.NCCL):
        print(f"  two-level job {line} (over NCCL, one rank per GPU: only with 2 or more GPUs)")
    parse_lighthouse([*elastic.LIGHTHOUSE, "--port", "0"])
    print(f"  elastic lighthouse: flags valid: {' '.join(elastic.LIGHTHOUSE)} --port 0 (a free one)")
    for line in check_jobs(ROOT, elastic.COMMON, elastic.jobs(), elastic.GPU):
        print(f"  elastic {line} (the lighthouse's port in place of {elastic.DRY_RUN_LIGHTHOUSE})")
    for line in check_jobs(ROOT, ENGINE_COMMON, [("job", 2, [*COMPILED_ZERO3, "--compile"])]):
        print(f"  zero3-compiled {line}")
    for path in (
        "run.sh",
        "tools/bench_quant.py",
        "tools/bench_model.py",
        "tools/plan.py",
        "tools/profile_loop.py",
        RUN_SH_CONFIG,
        "kernels/cuda_bitwise_check.py",
    ):
        if not (ROOT / path).exists():
            print(f"missing {path}")
            return 1
    print(f"source: {describe(ROOT)}")
    print("dry run: plan printed, engine, two-level and elastic flags valid; nothing was run")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu_check", help="report, logs, data and runs go here")
    parser.add_argument("--budget-s", type=float, default=470, help="skip steps once this much time is spent")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; run nothing (no GPU needed)")
    parser.add_argument("--wheels", default=None, help="(handled by gpu_check.sh) local wheel directory")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to see the plan)", file=sys.stderr)
        return 1
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out, time.monotonic() + args.budget_s, ROOT)
    outcomes: list[tuple[str, Outcome, float]] = []
    for name, _, estimate, fn in STEPS:
        started = time.monotonic()
        if ctx.left() < min(estimate, 60):
            outcome = Outcome("skipped", f"{ctx.left():.0f} s of the budget left, ~{estimate} s needed")
        else:
            try:
                outcome = fn(ctx)
            except Exception as exc:  # a parse or read failure is a failed step, not a lost report
                outcome = Outcome("FAILED", f"{type(exc).__name__}: {exc}")
        outcomes.append((name, outcome, time.monotonic() - started))
        print(f"{name}: {outcome.status}: {outcome.summary}", flush=True)
        write_report(out, outcomes, ROOT)
    statuses = {o.status for _, o, _ in outcomes}
    print(f"report: {out / 'report.md'}")
    return 1 if statuses & {"MISMATCH", "FAILED"} else 3 if "skipped" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
