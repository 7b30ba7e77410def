"""The same `run.sh` job on two sides (CUDA ranks and CPU ranks, by default), all started at
once, then judged by their losses: the engine step's comparison, shared by every step that
proves a training path on the GPU against the CPU (the engine's, the two-level jobs').

A side is a label, whether its ranks see the GPU, and the flags that place them there (ranks
sharing one GPU talk gloo; one rank per GPU may talk NCCL). With both sides on CPU ranks the
whole comparison runs without a GPU, which is how the tests exercise it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_check.commands import Context, Outcome, run_sh, tail
from benchmarks.gpu_check.commands import Job as Started
from benchmarks.gpu_check.parse import tb_losses

Job = tuple[str, int, list[str]]  # (name, ranks, flags)
RUN_SH_CONFIG = "configs/llama_tiny.yaml"  # run.sh's CONFIG when none is set, as in every job here
# the data step builds the tokenizer the jobs size their vocabulary from; a check before it
# (the dry run) names none, which changes nothing the check looks at
NO_DATA = ["--tokenizer-model", "none"]


@dataclass(frozen=True)
class Side:
    label: str  # in each command's log and TensorBoard name: PREFIX-JOB-LABEL
    gpu: bool  # False: CUDA hidden (CUDA_VISIBLE_DEVICES=)
    flags: tuple[str, ...] = ()
    what: str = ""  # the summary's words for these ranks


SHARED_GPU = Side("cuda", True, ("--distributed-backend", "gloo"), "CUDA ranks sharing the GPU")
CPU = Side("cpu", False, (), "CPU ranks")


def compare_on_sides(
    ctx: Context,
    prefix: str,
    common: Sequence[str],
    jobs: Sequence[Job],
    bounds: Mapping[str, float],
    sides: tuple[Side, Side] = (SHARED_GPU, CPU),
    timeout: float = 300,
) -> Outcome:
    """Every job on both sides at once; each job's losses (TensorBoard's train/loss) compared
    step by step: the largest relative gap against the job's bound."""
    procs = {
        f"{prefix}-{job[0]}-{side.label}": start_job(ctx, prefix, common, job, side, timeout)
        for job in jobs
        for side in sides
    }
    return judge_losses(ctx, prefix, jobs, bounds, sides, {label: job.collect() for label, job in procs.items()})


def start_job(
    ctx: Context, prefix: str, common: Sequence[str], job: Job, side: Side, timeout: float, save: bool = False
) -> Started:
    """`run.sh` with the job's flags on the side's ranks, named PREFIX-JOB-LABEL (its log, its
    TensorBoard run and, with `save`, its checkpoints under OUT/ckpt)."""
    name, ranks, flags = job
    label = f"{prefix}-{name}-{side.label}"
    return run_sh(
        ctx,
        label,
        [*common, *flags, *side.flags],
        ranks=ranks,
        gpu=side.gpu,
        timeout=min(timeout, ctx.left()),
        save=ctx.out / "ckpt" / label if save else None,
    )


def judge_losses(
    ctx: Context,
    prefix: str,
    jobs: Sequence[Job],
    bounds: Mapping[str, float],
    sides: tuple[Side, Side],
    results: Mapping[str, tuple[int, str]],
) -> Outcome:
    """The jobs' verdict from their results (exit status and output by PREFIX-JOB-LABEL): each
    job's losses (TensorBoard's train/loss under OUT/tb/PREFIX-JOB-LABEL) on the two sides,
    step by step, the largest relative gap against the job's bound; a failed command's tail."""
    first, second = sides
    lines = [
        f"| job | ranks | {first.label} losses | {second.label} losses | max relative gap | bound |",
        "|---|---:|---|---|---:|---:|",
    ]
    status, worst, failures = "ok", [], []
    for name, ranks, _ in jobs:
        a, b = (results[f"{prefix}-{name}-{side.label}"] for side in sides)
        if a[0] != 0 or b[0] != 0:
            status = "FAILED"
            lines.append(f"| {name} | {ranks} | exit {a[0]} | exit {b[0]} | | |")
            for side, (rc, text) in zip(sides, (a, b)):
                if rc != 0:
                    failures += [f"{name} on {side.label}, exit {rc}:", *tail(text, 12)]
            continue
        x = tb_losses(ctx.out / "tb" / f"{prefix}-{name}-{first.label}")
        y = tb_losses(ctx.out / "tb" / f"{prefix}-{name}-{second.label}")
        gap = relative_gap(x, y)
        if gap > bounds[name]:
            status = "MISMATCH" if status == "ok" else status
            worst.append(name)
        lines.append(
            f"| {name} | {ranks} | {', '.join(f'{v:.6f}' for v in x)} | {', '.join(f'{v:.6f}' for v in y)} "
            f"| {gap:.2e} | {bounds[name]:.0e} |"
        )
    summary = f"{len(jobs)} jobs on {first.what or first.label} vs {second.what or second.label}" + (
        f"; outside the bound: {', '.join(worst)}" if worst else ""
    )
    return Outcome(status, summary, lines + ([""] + failures if failures else []))


def relative_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest |a - b| / |b| over the steps; infinite when the runs logged other steps."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")


def check_jobs(root: Path, common: Sequence[str], jobs: Sequence[Job], side: Side = SHARED_GPU) -> list[str]:
    """Each job's flags as `run.sh` passes them (its default config first) checked as a run
    would check them, before any rank starts (every subsystem's options, the engine's and the
    outer ones included); a line per job. Raises the config's error for a job that is refused."""
    from megazpp.config.checks import check_config
    from megazpp.config.load import load_config

    lines = []
    for name, ranks, flags in jobs:
        cfg = load_config(["--config", str(root / RUN_SH_CONFIG), *NO_DATA, *common, *flags, *side.flags])
        check_config(cfg, ranks)
        lines.append(f"{name}: {ranks} ranks, flags valid: {' '.join(flags)}")
    return lines
