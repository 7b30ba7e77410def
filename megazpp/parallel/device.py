"""Which process-group backend and which device each rank of a node uses.

Why a rule of its own: NCCL needs one GPU per rank (it refuses two ranks on one device), gloo
runs anywhere and accepts CUDA tensors for most collectives (it stages them through pinned host
memory; `megazpp.parallel.comm` covers the rest). So several ranks can share one GPU only over
gloo, and that must be asked for (`parallel.distributed_backend: gloo`), since gloo moves every
byte through the host. The choice is checked once, before any rank starts (run.sh's check,
`megazpp.training.startup`), and each rank then takes its device from the same rule.

Ranks of a node share its GPUs round robin: local rank r uses GPU r mod (GPUs).
"""

from __future__ import annotations

from typing import Literal

import torch

from megazpp.errors import ConfigError

BackendChoice = Literal["auto", "nccl", "gloo"]
KEY = "parallel.distributed_backend"


def resolve_backend(requested: str, ranks_per_node: int, gpus: int) -> str:
    """The backend ("nccl" or "gloo") for `ranks_per_node` ranks on a node with `gpus` GPUs,
    or a one-line ConfigError where the request cannot work."""
    if requested not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"{KEY} = {requested!r}: expected auto, nccl or gloo")
    if requested == "gloo":
        return "gloo"
    if gpus == 0:
        if requested == "nccl":
            raise ConfigError(
                f"{KEY} = nccl: NCCL needs CUDA ranks and this machine has no usable GPU; use gloo (or auto)"
            )
        return "gloo"
    if ranks_per_node > gpus:
        raise ConfigError(
            f"{KEY} = {requested}: {ranks_per_node} ranks per node on {gpus} GPU(s) "
            f"would put several ranks on one GPU, which NCCL refuses; pass "
            f"--distributed-backend gloo (the ranks then share the GPUs round robin) "
            f"or start at most {gpus} ranks per node"
        )
    return "nccl"


def rank_device(local_rank: int, gpus: int) -> torch.device:
    """This rank's device: GPU `local_rank mod gpus`, or the CPU on a machine without GPUs."""
    if gpus == 0:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % gpus)


def visible_gpus() -> int:
    """GPUs this process can use (0 where torch has no CUDA or sees no device)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
