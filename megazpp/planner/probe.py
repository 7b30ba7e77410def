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
from dataclasses import dataclass
from typing import Any

import torch

from megazpp.parallel import comm

SMALL, LARGE = 1 << 10, 1 << 22  # fp32 elements: 4 KiB (latency), 16 MiB (bandwidth)


@dataclass(frozen=True)
class LinkProbe:
    bandwidth: float  # bytes/s one rank receives
    latency: float  # seconds per ring step


def _timed_all_reduce(numel: int, group: Any, repeats: int) -> float:
    t = torch.ones(numel)
    comm.all_reduce(t, group=group, tag="planner/probe")  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        comm.barrier(group=group, tag="planner/probe")
        start = time.perf_counter()
        comm.all_reduce(t, group=group, tag="planner/probe")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_link(group: Any, size: int, repeats: int = 5) -> LinkProbe:
    """Bandwidth and latency of `group` (`size` members) from two timed all-reduce sizes."""
    small = _timed_all_reduce(SMALL, group, repeats)
    large = _timed_all_reduce(LARGE, group, repeats)
    factor = 2 * (size - 1) / size
    bandwidth = factor * 4 * (LARGE - SMALL) / max(large - small, 1e-9)
    latency = max(0.0, small - factor * 4 * SMALL / bandwidth) / (2 * (size - 1))
    return LinkProbe(bandwidth, latency)


def probe_matmul_flops(n: int = 1024, repeats: int = 5, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> float:
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


def broadcast_values(values: list[float]) -> list[float]:
    """Rank 0's `values` on every rank (identical planner inputs, hence identical decisions)."""
    t = torch.tensor(values, dtype=torch.float64)
    comm.broadcast(t, src=0, tag="planner/probe")
    return t.tolist()
