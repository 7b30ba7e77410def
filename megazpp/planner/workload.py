"""The training job a plan is for: model, batch, model-parallel sizes, precision, options.

Why separate from the cluster: `paro_strategy: auto` describes the same job on a measured
cluster, and tools/plan.py the same job on clusters typed in by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazpp.config.schema import Config
from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.trainable import trainable_fraction
from megazpp.optim.options import ADAMW_STATE
from megazpp.planner.cluster import Cluster
from megazpp.zero.units import bucket_bound


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    micro_batch: int | None
    global_batch: int | None
    tp: int = 1
    pp: int = 1
    param_bytes: int = 2  # model dtype (bf16 / fp16: 2, fp32: 4)
    fp16: bool = False  # fp16 with loss scaling (LoCo then keeps a copy for skipped steps)
    accum_bytes: int = 4  # gradient accumulation dtype
    optimizer_states: int = len(ADAMW_STATE)  # fp32 state tensors per parameter (`OptimizerOptions.state_names`)
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = True
    trainable_fraction: float = 1.0  # PEFT: the rest of the weights is frozen (held at p, never reduced)
    paro_group_size: int | None = None  # None: the DP ranks of one node (the engine's default)
    hpz_size: int | None = None  # None: the DP ranks of one node (ZeRO++'s recommendation)
    bucket_numel: int = 500_000_000  # zero.units.bucket_bound of the zero section's two sizes
    module_granularity_threshold: int = 0
    fetch_groups: str = "layer"  # zero.fetch_groups
    max_live_parameters: int = 1_000_000_000  # zero.stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # zero.stage3_max_reuse_distance
    hierarchical: str = "auto"  # zero.hierarchical: two-stage G collectives (auto / always / never)
    persistence_threshold: int = 0  # zero.stage3_param_persistence_threshold
    train_iters: int | None = None  # the run's length: no two-level option whose first sync lands after it
    start_iter: int = 0  # outer.start_iter: the islands start there (their first sync is counted from it)

    def dp(self, cluster: Cluster) -> int:
        if cluster.world_size % (self.tp * self.pp):
            raise ConfigError(
                f"{cluster.world_size} accelerators ({cluster.nodes} nodes x "
                f"{cluster.gpus_per_node}) are not divisible by TP {self.tp} x PP {self.pp}"
            )
        if cluster.gpus_per_node % self.tp:
            raise ConfigError(
                f"tensor-parallel size {self.tp} must divide the {cluster.gpus_per_node} "
                f"accelerators of a node (a TP group may not span nodes)"
            )
        return cluster.world_size // (self.tp * self.pp)

    def batches(self) -> tuple[int, int]:
        """(micro batch, global batch); refused while either is unset."""
        if self.micro_batch is None or self.global_batch is None:
            raise ConfigError("the job needs a micro-batch size and a global batch size")
        return self.micro_batch, self.global_batch

    def micro_batches(self, cluster: Cluster) -> int:
        """Micro-batches per optimizer step (gradient accumulation steps) of each DP rank."""
        micro, global_batch = self.batches()
        per_step = micro * self.dp(cluster)
        if micro < 1 or global_batch < per_step or global_batch % per_step:
            raise ConfigError(
                f"global batch {global_batch} is not a positive multiple of micro batch "
                f"{micro} x data-parallel size {self.dp(cluster)} = {per_step}"
            )
        return global_batch // per_step


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def workload_of_config(cfg: Config) -> Workload:
    """The job a run's Config describes (global batch: as given, or one micro-batch per DP rank
    once `config.checks.validate_config` resolved it; None is left for the caller to fill)."""
    prec, par, z, t = cfg.precision, cfg.parallel, cfg.zero, cfg.training
    dtype = "bf16" if prec.bf16 else "fp16" if prec.fp16 else "fp32"
    return Workload(
        model=cfg.model,
        micro_batch=t.micro_batch_size,
        global_batch=t.global_batch_size,
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        param_bytes=DTYPE_BYTES[dtype],
        fp16=prec.fp16,
        accum_bytes=DTYPE_BYTES[prec.grad_accum_dtype],
        optimizer_states=len(cfg.optimizer.state_names),
        activation_checkpointing=cfg.model.activation_checkpointing,
        sequence_parallel=par.sequence_parallel,
        paro_group_size=z.paro_group_size,
        hpz_size=z.zero_hpz_partition_size if z.zero_hpz_partition_size > 1 else None,
        bucket_numel=bucket_bound(z.reduce_bucket_size, z.allgather_bucket_size),
        module_granularity_threshold=z.module_granularity_threshold,
        fetch_groups=z.fetch_groups,
        max_live_parameters=z.stage3_max_live_parameters,
        max_reuse_distance=z.stage3_max_reuse_distance,
        hierarchical=z.hierarchical,
        persistence_threshold=z.stage3_param_persistence_threshold,
        trainable_fraction=trainable_fraction(cfg.model, t.trainable),
        train_iters=t.train_iters,
        start_iter=cfg.outer.start_iter,
    )
