"""ZeroOptions: the settings a ZeroEngine is built with.

Why a module of its own: the builder above zero (`training/zero_factory.py`), the tools and the
tests construct options without needing the engine's machinery, and the engine module keeps
one job, running a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazpp.config.schema import ZeroConfig
from megazpp.zero import sequences
from megazpp.zero.zeropp import ZeroPP


@dataclass
class ZeroOptions:
    """How the engine partitions and moves state: the `zero` config section resolved (strategy
    parsed, ZeRO++ settings checked), under the section's own names and defaults."""

    strategy: str | int = "NNN"
    paro_group_size: int | None = ZeroConfig.paro_group_size  # None: the DP ranks on one node
    reduce_bucket_size: int = ZeroConfig.reduce_bucket_size
    allgather_bucket_size: int = ZeroConfig.allgather_bucket_size
    module_granularity_threshold: int = ZeroConfig.module_granularity_threshold
    fetch_groups: str = ZeroConfig.fetch_groups
    stage3_prefetch_bucket_size: int = ZeroConfig.stage3_prefetch_bucket_size
    stage3_max_live_parameters: int = ZeroConfig.stage3_max_live_parameters
    stage3_max_reuse_distance: int = ZeroConfig.stage3_max_reuse_distance
    stage3_param_persistence_threshold: int = ZeroConfig.stage3_param_persistence_threshold
    # a mode of traffic.HIERARCHY_MODES, or the per-kind choice made above zero (the planner)
    hierarchical: str | sequences.Hierarchy = ZeroConfig.hierarchical
    overlap_comm: bool = ZeroConfig.overlap_comm  # False: no prefetch, each reduction waited at once
    micro_batches_per_step: int | None = None  # known: start the boundary reduction in backward
    zeropp: ZeroPP = field(default_factory=ZeroPP)  # qwZ, hpZ, qgZ, LoCo
