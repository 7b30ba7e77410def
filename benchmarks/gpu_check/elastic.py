"""The device check's elastic step: two-level training with `--outer-elastic`, each island its
own `run.sh` job meeting the others at outer syncs through the membership service, started as
users start them (docs/arch/elastic.md): `python -m megazpp.launch.lighthouse --min-islands 2`,
then two islands of one rank each on the GPU (run.sh's default backend for one rank on one
GPU: NCCL inside the island), and the same on CPU ranks, all at once.

What only a GPU shows: the outer sync's buffers (the pseudo-gradient, with the inner AdamW
moments behind it in the same all-reduce, `outer.optimizer_state_every`'s default) are CUDA
tensors there, going through torchft's `ProcessGroupGloo` between the islands, and the
membership's start-up talks over an island world whose backend is NCCL.

The job: the default tiny model, H = 2 and 6 steps (a start exchange, then three syncs, the last
at the last step, where each island saves its checkpoint); each island reads its own claims of
the job's sample order (one train dataset, `--outer-train-samples`), and island 1 trains twice
island 0's global batch, so the islands weigh 1/3 and 2/3 in the mean. Judged: every island
finishes; each logged the three syncs with islands 0,1; each island's losses on the GPU against
the same island's on CPU ranks, within `BOUND`; and on each side the two islands' checkpoints at
the last sync hold the same model parameters, outer snapshot and AdamW moments, bit for bit (as
tests/test_outer_elastic.py asserts on CPU: both islands apply the same outer step to the same
mean on the same device).

Bound: the engine step's plain one (`settings.PLAIN_BOUND`), not the two-level step's quantized
one. An elastic island's outer wire is fp32 (compressed wires are refused with `elastic`) and so
is the tiny model here, so nothing rounds to a code that one ulp could flip: the CUDA side
differs from the CPU side by fp32 reductions summed in another order (a few ulps). The sync adds
no amplification of its own: the token-weighted mean is a convex combination, and the outer step
is linear in it (the defaults, lr 1 without momentum, make the mean the step; DiLoCo's 0.7 and
0.9 would scale a difference by at most 0.7 x 1.9 = 1.33). So six inner steps and three syncs
move the loss no more than the engine step's five Adam steps do: far under 100x a few ulps.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from benchmarks.gpu_check.commands import Context, Job, Outcome, start, tail
from benchmarks.gpu_check.pairs import CPU, Side, judge_losses, start_job
from benchmarks.gpu_check.settings import ENGINE_COMMON, PLAIN_BOUND
from megazpp.checkpoint.format import checkpoint_name, rank_file_name

PREFIX = "elastic"
H, ITERS = 2, 6
COMMON = [*ENGINE_COMMON, "--train-iters", str(ITERS), "--save-interval", str(ITERS)]
COMMON += ["--outer-algorithm", "diloco", "--outer-elastic", "--outer-sync-every", str(H)]
# both islands are needed at every sync; a lone island (the other failed) stops after this wait
# rather than at the 10-minute default, so a failure costs the budget little
COMMON += ["--outer-min-islands", "2", "--outer-quorum-timeout-s", "90"]
# one train dataset for the job (the islands' global sample order runs through it), the same on
# islands of other batch sizes: the default, each island's train_iters x global batch, would differ
COMMON += ["--outer-train-samples", "1000"]
ISLANDS = {0: [], 1: ["--global-batch-size", "32"]}  # island id: its own flags
LIGHTHOUSE = ["--min-islands", "2", "--heartbeat-timeout-ms", "5000", "--join-timeout-ms", "10000"]
GPU = Side("cuda", True, (), "CUDA islands (one rank each, run.sh's default backend)")
BOUND = dict.fromkeys((f"island{i}" for i in ISLANDS), PLAIN_BOUND)
DRY_RUN_LIGHTHOUSE = "127.0.0.1:29510"  # the dry run starts no lighthouse: any HOST:PORT checks alike


def island_flags(island: int, lighthouse: str) -> list[str]:
    return [*ISLANDS[island], "--outer-lighthouse", lighthouse, "--outer-island-id", str(island)]


def jobs(lighthouse: str = DRY_RUN_LIGHTHOUSE) -> list[tuple[str, int, list[str]]]:
    """The islands as `pairs.Job`s (name, ranks, flags after COMMON)."""
    return [(f"island{i}", 1, island_flags(i, lighthouse)) for i in ISLANDS]


def start_lighthouse(ctx: Context, side: Side) -> tuple[Job, str]:
    """The membership service on a free port (no GPU needed); its HOST:PORT once it listens."""
    cmd = [sys.executable, "-u", "-m", "megazpp.launch.lighthouse", *LIGHTHOUSE, "--port", "0"]
    job = start(ctx, f"{PREFIX}-lighthouse-{side.label}", cmd, 30, ctx.env(CUDA_VISIBLE_DEVICES=""))
    deadline = time.monotonic() + 60
    while (port := re.search(r"listening at \S+:(\d+) ", job.log.read_text())) is None:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            stop(job)
            raise RuntimeError(f"the lighthouse did not start: {' '.join(tail(job.log.read_text(), 8))}")
        time.sleep(0.1)
    return job, f"127.0.0.1:{port[1]}"


def stop(job: Job) -> None:
    """SIGTERM to the lighthouse's process group (it shuts its server down), then wait for it."""
    if job.proc.poll() is None:
        os.killpg(job.proc.pid, signal.SIGTERM)
    job.collect()


def synced_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model parameters, outer snapshot and inner AdamW moments an island (one rank) saved
    at its last step, its last sync."""
    path = ckpt / checkpoint_name(ITERS) / rank_file_name(0, 0, 0)
    state = torch.load(path, map_location="cpu", weights_only=False)
    engine = state["engine"]
    moments = {
        f"optimizer.{i}.{name}": t
        for i, per_param in engine["optimizer"]["state"].items()
        for name, t in per_param.items()
        if name in ("exp_avg", "exp_avg_sq")
    }
    if not moments:
        raise RuntimeError(f"{path}: no AdamW moments saved (the islands' averaged state is part of the check)")
    return {**{f"model.{k}": v for k, v in state["model"].items()}, "snapshot": engine["outer"]["snapshot"], **moments}


def sync_lines(log: str, island: int) -> list[tuple[int, int, str]]:
    """(sync, step, islands) of every outer sync the island logged."""
    found = re.findall(rf"outer: island {island}, outer sync (\d+) at step (\d+): islands (\d+(?:,\d+)*),", log)
    return [(int(s), int(step), ids) for s, step, ids in found]


def step_elastic(ctx: Context, sides: tuple[Side, Side] = (GPU, CPU)) -> Outcome:
    """A lighthouse and both islands per side, every side at once; then the losses side by side,
    each island's syncs, and the islands' checkpoints at the last sync (`sides`: the tests run
    both on CPU ranks)."""
    lighthouses: dict[str, tuple[Job, str]] = {}
    try:
        for side in sides:
            lighthouses[side.label] = start_lighthouse(ctx, side)
        islands = {
            f"{PREFIX}-{job[0]}-{side.label}": start_job(ctx, PREFIX, COMMON, job, side, 240, save=True)
            for side in sides
            for job in jobs(lighthouses[side.label][1])
        }
        results = {label: job.collect() for label, job in islands.items()}
    finally:
        for job, _ in lighthouses.values():
            stop(job)
    outcome = judge_losses(ctx, PREFIX, jobs(), BOUND, sides, results)
    outcome.summary = outcome.summary.replace(f"{len(ISLANDS)} jobs on", f"{len(ISLANDS)} elastic islands on")
    if outcome.status == "FAILED":
        return outcome
    for side in sides:
        logs = {i: results[f"{PREFIX}-island{i}-{side.label}"][1] for i in ISLANDS}
        agree, lines = islands_agree(ctx, side.label, logs)
        outcome.lines += lines
        if not agree:
            outcome.status = "MISMATCH"
            outcome.summary += f"; the islands disagree on {side.label}"
    return outcome


def islands_agree(ctx: Context, label: str, logs: Mapping[int, str]) -> tuple[bool, list[str]]:
    """Whether one side's islands (`logs`: each one's output by id) met at every sync and hold
    the same state at the last (their checkpoints under OUT/ckpt/elastic-island<I>-LABEL), and
    the report's lines saying so."""
    expected = [(s, s * H, ",".join(map(str, ISLANDS))) for s in range(1, ITERS // H + 1)]
    agree, lines = True, []
    for i, log in logs.items():
        met = sync_lines(log, i)
        if met != expected:
            agree = False
            lines.append(f"island {i} on {label}: (sync, step, islands) {met}, expected {expected}")
    a, b = (synced_state(ctx.out / "ckpt" / f"{PREFIX}-island{i}-{label}") for i in ISLANDS)
    differ = sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]
    lines.append(
        f"{label}: the islands' checkpoints at the last sync (step {ITERS}), {len(a)} tensors: "
        + (f"differ in {', '.join(differ[:8])}" if differ else "equal bit for bit")
    )
    return agree and not differ, lines
