"""The machine a plan is for: nodes, accelerators, memory, compute rate, and the two links.

Why the inter-node bandwidth is per NODE: every data-parallel rank of a node runs the same
collective at the same moment, so they share the node's network interface; the planner
divides it by the ranks per node to get what one rank sees. Intra-node bandwidth is per
accelerator (NVLink / NVSwitch ports belong to one GPU). Latencies are per message step of a
ring (see `megazpp.planner.timing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazpp.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """Typical values for a known accelerator (overridable one by one on the command line)."""

    memory_gib: float
    achievable_tflops: float  # dense 16-bit matmul rate a training step really reaches
    memory_bandwidth_gbs: float  # HBM, GB/s: the optimizer update is bound by it
    intra_gbs: float  # per-GPU NVLink / NVSwitch bandwidth, GB/s, one direction


ACCELERATORS: dict[str, Accelerator] = {
    # V100-SXM3 (DGX-2, NVSwitch): 125 TFLOP/s fp16 peak, ~40 % reached in large GPT training
    "v100-32gb": Accelerator(32, 50, 900, 150),
    # A100-SXM4 80 GB: 312 TFLOP/s bf16 peak
    "a100-80gb": Accelerator(80, 150, 2000, 300),
    # H100-SXM5 80 GB: 989 TFLOP/s bf16 dense peak, ~40 %; NVLink4 450 GB/s per direction
    "h100-80gb": Accelerator(80, 400, 3350, 450),
}


@dataclass(frozen=True)
class Cluster:
    """Everything about the hardware the prediction needs, in SI units (bytes, seconds)."""

    nodes: int
    gpus_per_node: int
    memory_bytes: float  # per accelerator
    flops: float  # achievable FLOP/s per accelerator
    intra_bw: float  # bytes/s per accelerator
    inter_bw: float  # bytes/s per node (shared by its ranks)
    intra_latency: float = 5e-6  # seconds per ring step
    inter_latency: float = 15e-6
    memory_bw: float = 2e12  # bytes/s, HBM
    usable_memory_fraction: float = 0.9  # the rest: allocator fragmentation, workspaces, context
    backend: str = "nccl"  # "gloo": reduce-scatter runs as a full all-reduce on the wire
    overlap: bool = True  # False: communication never hides behind compute (CPU cores doing both)
    # os elements one rank's AdamW updates per second, measured (`probe.probe_optimizer_rate`);
    # None: the update is memory bound, (28 + param bytes) per element at memory_bw
    optimizer_rate: float | None = None
    # measured time of "<op>/<group>" (op: all_gather, reduce_scatter, all_reduce; group: a
    # DPShapes name) as ascending (received bytes, seconds) points, from
    # `probe.probe_collectives`; replaces latency and link bandwidth for that pair, which
    # misjudge backends whose collectives cost host time (gloo on shared CPU cores)
    collective_times: dict[str, tuple[tuple[float, float], ...]] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"cluster.{name} = {getattr(self, name)!r}: expected a positive integer")
        for name in ("memory_bytes", "flops", "intra_bw", "inter_bw", "memory_bw"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cluster.{name} = {getattr(self, name)!r}: expected a positive number")
        if self.optimizer_rate is not None and not self.optimizer_rate > 0:
            raise ConfigError(f"cluster.optimizer_rate = {self.optimizer_rate!r}: expected a positive number or None")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cluster.{name} = {getattr(self, name)!r}: expected a number >= 0")
        if not 0 < self.usable_memory_fraction <= 1:
            raise ConfigError(
                f"cluster.usable_memory_fraction = {self.usable_memory_fraction!r}: expected a fraction in (0, 1]"
            )
        if self.backend not in ("nccl", "gloo"):
            raise ConfigError(f"cluster.backend = {self.backend!r}: expected 'nccl' or 'gloo'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_bw_per_rank(self) -> float:
        return self.inter_bw / self.gpus_per_node


def gbit(x: float) -> float:
    """Gbit/s -> bytes/s."""
    return x * 1e9 / 8
