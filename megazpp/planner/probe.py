"""Measure what the planner needs from the running cluster: link bandwidth, latency, FLOP/s.

Why timed all-reduces through `comm`: they run on the same backend and groups the engine
will use, and fitting t(n) = 2 (g - 1) latency + 2 (g - 1) / g * n / bandwidth at a small and
a large size separates latency from bandwidth. Every rank of a node probes its inter-node
group at the same time, as the engine's collectives will, so the per-rank rate measured is
already the node's link shared by its ranks; the node's bandwidth is that times the ranks per
node. Ranks measure different numbers; the caller broadcasts rank 0's (`broadcast_values`) so
every rank plans from identical inputs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megazpp.model.config import ModelConfig
from megazpp.model.flops import training_flops_per_token
from megazpp.model.gpt import GPTModel
from megazpp.optim.optimizer import build_adamw
from megazpp.optim.options import OptimizerOptions
from megazpp.parallel import comm
from megazpp.parallel.counter import counter
from megazpp.parallel.topology import Topology
from megazpp.planner.cluster import Cluster, gbit

SMALL, LARGE = 1 << 10, 1 << 22  # fp32 elements: 4 KiB (latency), 16 MiB (bandwidth)


@dataclass(frozen=True)
class LinkProbe:
    bandwidth: float  # bytes/s one rank receives
    latency: float  # seconds per ring step


def _timed_all_reduce(numel: int, group: ProcessGroup | None, repeats: int) -> float:
    t = torch.ones(numel)
    comm.all_reduce(t, group=group, tag="planner/probe")  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        comm.barrier(group=group, tag="planner/probe")
        start = time.perf_counter()
        comm.all_reduce(t, group=group, tag="planner/probe")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_link(group: ProcessGroup | None, size: int, repeats: int = 5) -> LinkProbe:
    """Bandwidth and latency of `group` (`size` members) from two timed all-reduce sizes."""
    small = _timed_all_reduce(SMALL, group, repeats)
    large = _timed_all_reduce(LARGE, group, repeats)
    factor = 2 * (size - 1) / size
    bandwidth = factor * 4 * (LARGE - SMALL) / max(large - small, 1e-9)
    latency = max(0.0, small - factor * 4 * SMALL / bandwidth) / (2 * (size - 1))
    return LinkProbe(bandwidth, latency)


def probe_matmul_flops(
    n: int = 1024, repeats: int = 5, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """FLOP/s of an n x n x n matmul on this rank (a ceiling of what training reaches)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        if a.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times[1:])


def probe_model_flops(cfg: ModelConfig, micro_batches: int, micro_batch_size: int, rounds: int, seed: int) -> float:
    """FLOP/s of one rank's forward + backward of the model `cfg` (no communication), timed from
    a barrier until the last rank is done, averaged over `rounds` x 2 rounds of `micro_batches`
    after two warm-up rounds (allocator growth, first-touch pages): ranks sharing cores run at
    once, and a step's collectives wait for the slowest, so this is the rate a step sees (a rank
    timing only itself read 30-50 % high or low, as the scheduler favoured it or not).
    Collective (the barriers)."""
    model = GPTModel(cfg)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (micro_batches, micro_batch_size, cfg.seq_length + 1), generator=g)
    batches = [(x[:, :-1], x[:, 1:]) for x in ids]
    times = []
    for i, (x, y) in enumerate(batches * (2 * rounds + 2)):
        comm.barrier(tag="calibrate")
        start = time.perf_counter()
        model(x, y).mean().backward()
        comm.barrier(tag="calibrate")
        if i >= 2 * len(batches):
            times.append(time.perf_counter() - start)
    return training_flops_per_token(cfg) * micro_batch_size * cfg.seq_length / statistics.fmean(times)


COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def dp_groups(topology: Topology) -> dict[str, tuple[ProcessGroup | None, int]]:
    """The launcher's data-parallel groups under the names `sequences.DPShapes` gives them (the
    PaRO group and the hpZ group default to the node's DP ranks)."""
    node = (topology.dp_intra_group, len(topology.dp_intra_ranks))
    return {
        "dp": (topology.dp_group, topology.dp),
        "intra": node,
        "hpz": node,
        "cross": (topology.dp_inter_group, len(topology.dp_inter_ranks)),
    }


def probe_host(
    topology: Topology, optimizer: bool = True
) -> tuple[dict[str, tuple[tuple[float, float], ...]], float | None]:
    """Rank 0's collective times and (with `optimizer`) AdamW rate, on every rank: the host
    model's inputs (`Cluster.collective_times`, `Cluster.optimizer_rate`). Collective. Without
    `optimizer` no optimizer steps (pricing collectives needs none, and a benchmark that counts
    calls per optimizer step would count the probe's)."""
    times = probe_collectives(dp_groups(topology))
    keys = sorted(times)  # the same on every rank: the topology is symmetric
    comm.barrier(tag="planner/probe")  # every rank at once, as in a step: they share the cores
    flat = broadcast_values(
        [*(x for k in keys for point in times[k] for x in point), probe_optimizer_rate() if optimizer else 0.0]
    )
    per_key = len(flat[:-1]) // max(len(keys), 1)
    return (
        {
            k: tuple(zip(flat[i * per_key : (i + 1) * per_key : 2], flat[i * per_key + 1 : (i + 1) * per_key : 2]))
            for i, k in enumerate(keys)
        },
        flat[-1] if optimizer else None,
    )


def _timed_calls(call: Callable[[], object], group: ProcessGroup | None, repeats: int, rounds: int = 4) -> float:
    """Mean seconds per call over `rounds` of `repeats` calls issued back to back, as a step
    issues them. Not a barrier before each call: it would line the ranks up and hide the time a
    call waits for a peer the scheduler has not run yet, most of a call's cost when ranks
    outnumber cores. Not a median: a step pays the host's occasional stalls too."""
    call()  # warm-up: connections, buffers
    total = 0.0
    for _ in range(rounds):
        comm.barrier(group=group, tag="planner/probe")
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        total += time.perf_counter() - start
    return total / (rounds * repeats)


def _calls(op: str, numel: int, size: int, group: ProcessGroup | None) -> Callable[[], object]:
    """A call of `op` moving `numel` elements per member, made as the ZeRO engine makes it
    (`zero.collectives`: into / in place on views of one flat buffer)."""
    shard, whole = torch.ones(numel), torch.ones(numel * size)
    parts = list(whole.chunk(size))
    if op == "all_gather":
        return lambda: comm.all_gather_into_parts(parts, shard, group=group, tag="planner/probe")
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter_parts(whole, parts, group=group, tag="planner/probe").wait()
    return lambda: comm.all_reduce(whole, group=group, tag="planner/probe")


def _recorded(call: Callable[[], object]) -> float:
    """Bytes (intra + inter) the counter records for one `call`: the axis `timing.measured_time`
    reads the points on, the formula `traffic.collective_bytes` prices (`parallel.wire`)."""
    before = counter.step_totals()
    call()
    after = counter.step_totals()
    return float(after["intra"] + after["inter"] - before["intra"] - before["inter"])


def probe_collectives(
    groups: dict[str, tuple[ProcessGroup | None, int]],
    sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20),
    repeats: int = 5,
) -> dict[str, tuple[tuple[float, float], ...]]:
    """Ascending (received bytes, seconds per call) points of each op in `COLLECTIVE_OPS` on each
    named group ({"dp": (group, size), ...}, the DPShapes names), keyed "<op>/<name>", at
    `sizes` elements per member: 4 KiB (the call itself), 256 KiB and 4 MiB of fp32 (parameter
    units and buckets); a group under two names (the hpZ group is the node's) is timed once. A
    time below the previous size's (noise on a loaded host) is raised to it. Collective: every
    rank calls it with the same groups, so the groups of every node run at once, as in a step."""
    out: dict[str, tuple[tuple[float, float], ...]] = {}
    timed: dict[tuple[int, str], tuple[tuple[float, float], ...]] = {}  # a group under two names: once
    for name, (group, size) in groups.items():
        if size < 2:
            continue
        for op in COLLECTIVE_OPS:
            if (id(group), op) not in timed:
                points: list[tuple[float, float]] = []
                for numel in sorted(sizes):
                    call = _calls(op, numel, size, group)
                    received = _recorded(call)
                    seconds = _timed_calls(call, group, repeats)
                    points.append((received, max(seconds, points[-1][1] if points else 0.0)))
                timed[(id(group), op)] = tuple(points)
            out[f"{op}/{name}"] = timed[(id(group), op)]
    return out


def probe_optimizer_rate(numel: int = 1 << 22, repeats: int = 5) -> float:
    """Elements per second the engines' own AdamW (`build_adamw`) updates on this rank: on CPU
    its foreach kernels make several passes per element, far from the memory-bound ideal."""
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    optimizer = build_adamw([{"params": [param], "weight_decay": 0.1}], OptimizerOptions())
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times[1:])


def probe_memory_bandwidth(numel: int = 1 << 23, repeats: int = 5) -> float:
    """Bytes/s of an in-place add over 32 MiB fp32 (read two, write one) on this rank."""
    x, y = torch.ones(numel), torch.ones(numel)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x.add_(y)
        times.append(time.perf_counter() - start)
    return 3 * 4 * numel / statistics.median(times[1:])


def broadcast_values(values: list[float]) -> list[float]:
    """Rank 0's `values` on every rank (identical planner inputs, hence identical decisions)."""
    t = torch.tensor(values, dtype=torch.float64)
    comm.broadcast(t, src=0, tag="planner/probe")
    return t.tolist()


@dataclass(frozen=True)
class Measured:
    """What the calibration tools compare their predictions on: the gloo cluster these ranks
    measured (no collective times in it), the host's collective times, and the link between
    nodes as probed (the cluster's, unless a rate was given instead)."""

    cluster: Cluster
    collective_times: dict[str, tuple[tuple[float, float], ...]]
    probed_inter_bw: float


def measured_cluster(
    host: Topology,
    flops: float,
    intra: LinkProbe,
    inter: LinkProbe,
    *,
    nodes: int,
    ranks_per_node: int,
    inter_gbit: float | None,
    overlap: bool,
) -> Measured:
    """The cluster these ranks measured, the same on every rank (rank 0's values): the model's
    `flops` and the `intra` / `inter` links the caller probed on the groups its job uses, the
    host model (`probe_host` on `host`) and the memory bandwidth probed here; `inter_gbit`, when
    given, in place of the probed link between nodes. Collective."""
    fits, adam = probe_host(host)
    comm.barrier(tag="calibrate")
    inter_bw = inter.bandwidth * ranks_per_node
    values = broadcast_values(
        [flops, probe_memory_bandwidth(), intra.bandwidth, inter_bw, intra.latency, inter.latency]
    )
    cluster = Cluster(
        nodes=nodes,
        gpus_per_node=ranks_per_node,
        memory_bytes=float(1 << 40),
        flops=values[0],
        intra_bw=values[2],
        inter_bw=gbit(inter_gbit) if inter_gbit else values[3],
        intra_latency=values[4],
        inter_latency=values[5],
        memory_bw=values[1],
        backend="gloo",
        overlap=overlap,
        optimizer_rate=adam,
    )
    return Measured(cluster, fits, values[3])
