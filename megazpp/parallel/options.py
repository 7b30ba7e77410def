"""ParallelOptions: the `parallel` config section, the layout of the ranks, checked when built.

Why here: tensor and pipeline sizes, sequence parallelism, the ranks per node and the backend are
parallelism's own settings (topology, process groups and the tensor-parallel layers read them),
so the section is defined beside them with each field's help, and the config layer above maps
YAML keys and flags onto its fields by name. Rules of its own values are checked in the
constructor, naming the key; those that need the world size or the model (dp = world / (tp x
pp), the model's split) are the config check's (`config.checks`), once, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megazpp.errors import ConfigError
from megazpp.setting import require_positive, setting


@dataclass(frozen=True)
class ParallelOptions:
    """Parallel layout; dp = world_size / (tp x pp) is derived, never set."""

    tensor_model_parallel_size: int = setting(1, "tensor-parallel ranks")
    pipeline_model_parallel_size: int = setting(1, "pipeline stages")
    sequence_parallel: bool = setting(False, "split norms and dropout over the tensor-parallel ranks")
    # None: from the launcher (LOCAL_WORLD_SIZE)
    ranks_per_node: int | None = setting(None, "ranks per (virtual) node; none: the launcher's")
    distributed_timeout_minutes: int = setting(10, "a collective waiting longer fails")
    # auto: NCCL on CUDA ranks (one GPU each), gloo on CPU ranks; gloo on CUDA lets several
    # ranks share a GPU (megazpp.parallel.device)
    distributed_backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto",
        "auto (nccl on GPUs, gloo on CPUs), nccl, or gloo (also on CUDA: several ranks may then share one GPU, round "
        "robin)",
    )

    def __post_init__(self) -> None:
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "ranks_per_node",
            "distributed_timeout_minutes",
        ):
            require_positive(f"parallel.{key}", getattr(self, key))
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                "parallel.sequence_parallel = true needs "
                "parallel.tensor_model_parallel_size > 1 (it splits the sequence "
                "over the tensor-parallel ranks)"
            )
