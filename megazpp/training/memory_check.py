"""Refuse, before any rank starts, a run whose estimated peak memory per rank exceeds what the
device has free: the planner's memory model against MemAvailable (CPU ranks) or free GPU
memory.

Why: `--seq-length 1000000` used to be accepted; the run grew to 24 GB without a word and the
kernel's OOM killer ended it a minute later (on a shared host it could have taken other jobs
first). The planner already predicts a rank's memory for every strategy (`planner.plan.predict`:
model state by `zero.memory`, activations by `planner.activations`, the transient gather and
reduce buffers); this module asks it for the run's own strategy and compares.

The estimate per rank = the planner's prediction for the fullest pipeline stage, its
activations scaled from the planner's 16-bit count to the model's dtype (an fp32 model keeps
4-byte activations), + the memory this process holds now (the interpreter, torch and the
project imported: what each rank holds before its first tensor).

The margin, measured on this project's 2-core CPU machine (fp32, one rank, SDPA's fused CPU
attention, micro-batch 2, 2 steps; peak RSS of the process against the estimate):
    llama 2 layers, hidden 128, seq 8192     peak 0.94 GiB, estimate 0.76 GiB (1.23x)
    llama 2 layers, hidden 64, seq 32768     peak 1.68 GiB, estimate 1.40 GiB (1.20x)
    llama 4 layers, hidden 256, seq 4096     peak 1.38 GiB, estimate 1.02 GiB (1.35x)
    llama 2 layers, hidden 32, seq 32        peak 0.38 GiB, estimate 0.37 GiB (the runtime)
So the estimate is a little low, never pessimistic: the check refuses only runs that cannot
fit (the 1e6-token sequence asks for about 80 GiB against 22 GiB free), and a run estimated
just under the free memory may still not fit. tests/test_reliability_startup.py bounds the
ratio for an activation-dominated run.
`--skip-memory-check` runs anyway.
"""

from __future__ import annotations

import dataclasses
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from megazpp.config.options import RunOptions
from megazpp.errors import ConfigError
from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.plan import Option, predict
from megazpp.planner.shape import shapes_of_config
from megazpp.planner.workload import workload_of_config
from megazpp.zero.strategy import PlannerChoice, parse_strategy
from megazpp.zero.zeropp import ZeroPP

# predict() prices time too; these rates only feed time terms, which are not read here
_UNUSED_RATE = 1e12


@dataclass(frozen=True)
class Available:
    bytes_per_rank: float
    where: str  # how it was found, for the message


def available_memory(ranks_on_node: int, usable_fraction: float) -> Available | None:
    """Free device memory per rank of this node: where CUDA is available, the smallest free
    GPU memory (ranks sharing a GPU share it) times the planner's `usable_memory_fraction`
    (the rest: the rank's CUDA context, allocator fragmentation, workspaces); else
    MemAvailable divided among the node's ranks; None where neither can be read."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(count))
        share = -(-ranks_on_node // count)
        return Available(
            free * usable_fraction / share,
            f"{free / GIB:.1f} GiB free on the fullest GPU x planner."
            f"usable_memory_fraction {usable_fraction}" + (f" / {share} ranks on it" if share > 1 else ""),
        )
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in lines if line.startswith("MemAvailable:")), None)
    if kib is None:
        return None
    return Available(
        kib * 1024 / ranks_on_node, f"MemAvailable {kib / 2**20:.1f} GiB / {ranks_on_node} ranks on this node"
    )


def runtime_bytes() -> float:
    """On CPU ranks, this process's peak resident memory: the interpreter, torch and the
    project imported, which every rank holds too. GPU ranks hold it on the host, not on the
    device (their CUDA context is in `available_memory`'s reserve)."""
    if torch.cuda.is_available():
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


@dataclass(frozen=True)
class Estimate:
    state: float
    activations: float
    transient: float
    runtime: float

    @property
    def total(self) -> float:
        return self.state + self.activations + self.transient + self.runtime


def estimate_peak(run: RunOptions, ranks_per_node: int) -> Estimate | None:
    """The planner's peak memory of the fullest rank of this run (`run`: its checked options);
    None under `paro_strategy: auto` (the planner then picks a strategy that fits, once the
    ranks measured the machine)."""
    cfg, options, world_size = run.config, run.zero, run.world_size
    if isinstance(options.strategy, PlannerChoice):
        return None
    dp = cfg.data_parallel_size(world_size)
    zero = run.uses_zero_engine
    strategy = options.strategy if zero else parse_strategy("NNN")
    workload = workload_of_config(cfg)
    rpn = min(ranks_per_node, world_size)
    if world_size % rpn or rpn % cfg.tp:  # the planner lays out whole nodes of whole TP groups;
        rpn = world_size  # the node split changes only the default PaRO / hpZ group sizes
    dp_on_node = max(1, min(dp, rpn // cfg.tp))
    # ZeRO++ as the engine runs it: hpZ lowered to the DP ranks of a node, off with one DP rank
    zeropp = (
        dataclasses.replace(options.zeropp, hpz=min(options.zeropp.hpz, dp_on_node)) if zero and dp > 1 else ZeroPP()
    )
    shapes = shapes_of_config(
        cfg.model,
        tp=cfg.tp,
        pp=cfg.pp,
        bucket_numel=workload.bucket_numel,
        threshold=options.module_granularity_threshold,
        fetch_mode=options.fetch_groups,
        trainable_fraction=workload.trainable_fraction,
        persistence=options.stage3_param_persistence_threshold,
    )
    cluster = Cluster(
        nodes=max(1, world_size // rpn),
        gpus_per_node=rpn,
        memory_bytes=1.0,
        flops=_UNUSED_RATE,
        intra_bw=_UNUSED_RATE,
        inter_bw=_UNUSED_RATE,
        backend="nccl" if torch.cuda.is_available() else "gloo",
    )
    fullest = predict(Option(strategy, zeropp), shapes, workload, cluster).fullest
    # the planner counts 16-bit activations (Megatron's estimate); an fp32 model keeps 4-byte ones
    activations = fullest.activation_bytes * workload.param_bytes / 2
    return Estimate(fullest.state.total + fullest.frozen_bytes, activations, fullest.transient_bytes, runtime_bytes())


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def check_memory(run: RunOptions, ranks_on_node: int) -> None:
    """Refuse a run estimated to need more memory per rank than this node has free for it."""
    cfg = run.config
    if cfg.training.skip_memory_check:
        return
    rpn = cfg.parallel.ranks_per_node or ranks_on_node
    estimate = estimate_peak(run, rpn)
    available = available_memory(ranks_on_node, cfg.planner.usable_memory_fraction)
    if estimate is None or available is None or estimate.total <= available.bytes_per_rank:
        return
    m, t = cfg.model, cfg.training
    raise ConfigError(
        f"this run needs about {_gib(estimate.total)} of memory per rank (planner estimate: "
        f"model state {_gib(estimate.state)}, activations {_gib(estimate.activations)}, buffers "
        f"{_gib(estimate.transient)}, runtime {_gib(estimate.runtime)}), but "
        f"{_gib(available.bytes_per_rank)} is available per rank ({available.where}): lower "
        f"--seq-length ({m.seq_length}) or --micro-batch-size ({t.micro_batch_size}), add "
        "--recompute-activations, shard more (a higher zero stage, more ranks) or use a smaller "
        "model; or pass --skip-memory-check to run anyway"
    )
