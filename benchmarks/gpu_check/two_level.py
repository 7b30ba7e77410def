"""The device check's two-level step: islands of synchronous ZeRO joined by DiLoCo outer steps,
on CUDA ranks, against the same jobs on CPU ranks (the engine step's comparison, `pairs.py`).

Representative jobs, each on 4 ranks = 2 islands of 2 (`--ranks-per-node 2`, one node an
island), on the default tiny model for 5 steps (every fragment syncs at least once): the int4
outer wire with error feedback under ZeRO-2, after one synchronous step (`outer.start_iter`:
the switch's host copies and their way back onto the device) and with AdamW's moments averaged
across islands every second sync; streaming (3 fragments, an exchange overlapping 1 inner step)
with the bf16 wire under ZeRO-3 and the SGD inner optimizer (torch's fused kernel on CUDA; its
momentum buffer averaged at every sync, the default); and both at once
(int4, 2 fragments, overlap 1) under ZeRO-3 with qwZ + hpZ + qgZ. They run on ranks sharing the
GPU over gloo, as the engine step's jobs do. With 2 or more GPUs, one more job runs over NCCL,
one rank per GPU (2 islands of 1): the production layout; on one GPU that job is skipped, with a line saying so.

Bounds: every job rounds on a wire (int4 or bf16 outer gradients, ZeRO++'s int8/int4 codes),
so a reduction summed in another order on the GPU can flip one code, moving that element by a
quantization step (bf16: 2^-8 relative; int4: 1/7 of its block's absmax), the engine step's
quantized case (`settings.QUANTIZED_BOUND`); error feedback carries what the flip dropped into
the next sync rather than letting it grow.
"""

from __future__ import annotations

from benchmarks.gpu_check.commands import Context, Outcome
from benchmarks.gpu_check.pairs import CPU, SHARED_GPU, Job, Side, compare_on_sides
from benchmarks.gpu_check.settings import ENGINE_COMMON, QUANTIZED_BOUND, ZEROPP

PREFIX = "two-level"
COMMON = [*ENGINE_COMMON, "--outer-algorithm", "diloco"]  # 5 steps, as the engine's jobs
ISLANDS = ["--ranks-per-node", "2"]
JOBS: list[Job] = [
    (
        "zero2-int4",
        4,
        ["--zero-stage", "2", "--outer-sync-every", "2", "--outer-quantize", "int4", *ISLANDS]
        + ["--outer-start-iter", "1", "--outer-optimizer-state-every", "2"],
    ),
    (
        "zero3-stream",
        4,
        [
            "--zero-stage",
            "3",
            "--optimizer",
            "sgd",
            "--outer-sync-every",
            "3",
            "--outer-quantize",
            "bf16",
            "--outer-fragments",
            "3",
            "--outer-overlap-steps",
            "1",
            *ISLANDS,
        ],
    ),
    (
        "zeropp-int4-stream",
        4,
        [
            *ZEROPP,
            "--outer-sync-every",
            "3",
            "--outer-quantize",
            "int4",
            "--outer-fragments",
            "2",
            "--outer-overlap-steps",
            "1",
            *ISLANDS,
        ],
    ),
]
# one rank per GPU over NCCL: 2 islands of one rank each (ZeRO inside an island of one is the
# local engine; the outer exchange is what crosses NCCL here)
NCCL_JOB: Job = ("int4-nccl", 2, ["--outer-sync-every", "2", "--outer-quantize", "int4", "--ranks-per-node", "1"])
NCCL = Side("nccl", True, ("--distributed-backend", "nccl"), "CUDA ranks, one per GPU, over NCCL")
BOUND = {name: QUANTIZED_BOUND for name, _, _ in [*JOBS, NCCL_JOB]}


def step_two_level(ctx: Context, sides: tuple[Side, Side] = (SHARED_GPU, CPU), gpus: int | None = None) -> Outcome:
    """The shared-GPU jobs against CPU ranks, then the NCCL job where there are 2 GPUs or more.
    `sides` and `gpus` (default: what torch sees) let the tests run it all on CPU ranks."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    outcome = compare_on_sides(ctx, PREFIX, COMMON, JOBS, BOUND, sides)
    if gpus < 2:
        outcome.lines += ["", f"{NCCL_JOB[0]}: skipped: NCCL needs one GPU per rank, and this machine has {gpus}"]
        outcome.summary += f"; NCCL job skipped ({gpus} GPU)"
        return outcome
    nccl = compare_on_sides(ctx, PREFIX, COMMON, [NCCL_JOB], BOUND, (NCCL, sides[1]) if sides[0].gpu else sides)
    order = ["ok", "MISMATCH", "FAILED"]
    status = max(outcome.status, nccl.status, key=order.index)
    return Outcome(status, f"{outcome.summary}; {nccl.summary}", [*outcome.lines, "", *nccl.lines])
