"""The `planner` config section: the cluster facts `paro_strategy: auto` cannot see itself.

Why a section of its own, and why in the config layer: the topology (nodes, ranks per node) is
known at start-up, but the network's bandwidths and the accelerator's rate are not; a user
states them here or asks for a short probe. The planner that reads them sits above the config
(it prices a whole run), so the section lives here, below it, and is checked when built like
every subsystem's section.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megazpp.errors import ConfigError
from megazpp.setting import setting


@dataclass(frozen=True)
class PlannerSettings:
    """Fields left None are probed when `probe` is true, and refused (ConfigError) otherwise;
    accelerator memory defaults to the device's own size on CUDA."""

    probe: bool = setting(False, "measure links and compute at start-up")
    accelerator_memory_gib: float | None = setting(None, "memory per accelerator; none: the device's")
    achievable_tflops: float | None = setting(None, "sustained TFLOP/s per accelerator")
    intra_node_gbs: float | None = setting(None, "GB/s per accelerator inside a node")
    inter_node_gbit: float | None = setting(None, "Gbit/s per node between nodes")
    intra_node_latency_us: float = setting(5.0, "latency of an intra-node collective step")
    inter_node_latency_us: float = setting(15.0, "latency of an inter-node collective step")
    memory_bandwidth_gbs: float = setting(2000.0, "accelerator memory bandwidth")
    usable_memory_fraction: float = setting(0.9, "share of memory the plan may fill")

    def missing(self, *, device_memory: bool, intra: bool, inter: bool) -> list[str]:
        """Every key `paro_strategy: auto` needs here and this section leaves unset, to be named
        at once before any rank starts (`planner.auto` asks for each where it uses it, on every
        rank: one per attempt). `device_memory`: a CUDA device tells the memory; `intra` /
        `inter`: the run has collectives on links inside a node / across nodes or islands. A
        probe measures the rest, but not the memory."""
        needed = [("accelerator_memory_gib", not device_memory)]
        if not self.probe:
            needed += [("achievable_tflops", True), ("intra_node_gbs", intra), ("inter_node_gbit", inter)]
        return [f"planner.{key}" for key, need in needed if need and getattr(self, key) is None]

    def __post_init__(self) -> None:
        """ConfigError naming the key for a value that is not a positive number."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "probe" and value is not None and not value > 0:
                raise ConfigError(f"planner.{f.name} = {value!r}: expected a positive number")
        if self.usable_memory_fraction > 1:
            raise ConfigError(
                f"planner.usable_memory_fraction = {self.usable_memory_fraction!r}: expected a fraction in (0, 1]"
            )
