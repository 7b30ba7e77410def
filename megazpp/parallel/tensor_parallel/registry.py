"""Which parameters are tensor-parallel shards, kept beside the parameters, not on them.

Why a registry: optimizers, gradient-norm code and checkpoints must know whether a parameter
is a shard (its norm contribution is summed over TP ranks) or a replica (counted once), and
the project keeps such state out of `nn.Parameter` attributes (docs/architecture.md, "State is
explicit").
"""

from __future__ import annotations

import weakref

import torch

_sharded: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def mark_tp_sharded(p: torch.Tensor, dim: int) -> None:
    """Record that `p` holds this rank's slice of the full tensor along `dim`."""
    key = id(p)
    _sharded[key] = (weakref.ref(p, lambda _ref: _sharded.pop(key, None)), dim)


def _entry(p: torch.Tensor) -> tuple[weakref.ref[torch.Tensor], int] | None:
    entry = _sharded.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry


def param_is_tp_sharded(p: torch.Tensor) -> bool:
    return _entry(p) is not None


def tp_partition_dim(p: torch.Tensor) -> int | None:
    """The dimension along which `p` is sharded over TP ranks, or None for a replica."""
    entry = _entry(p)
    return None if entry is None else entry[1]
