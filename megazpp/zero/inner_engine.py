"""What is asked of a ZeRO engine from outside its step: its layout (`ShardedEngine`, for the
banner and the checkpoints), and what the outer loop of two-level training needs of the engine
inside an island (`InnerEngine`).

Why protocols: the outer loop (`megazpp.outer.diloco`) replaces the fp32 masters between
steps, cuts fragments of them, weighs its norms like the engine's and reports its memory;
with this seam it needs nothing of the buckets, groups, paths or formulas that make those, so
the engine may change inside and the outer loop may wrap another engine that offers the same.
The banner and the checkpoint manager ask `ShardedEngine` whatever wraps the engine.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from megazpp.optim.engine_protocol import Engine
from megazpp.zero import memory
from megazpp.zero.shard_map import ShardLayout, ShardMap


@runtime_checkable
class ShardedEngine(Protocol):
    """An engine whose state is laid out over data-parallel ranks by a PaRO strategy."""

    def shard_layout(self) -> ShardLayout: ...


class InnerEngine(Engine, ShardedEngine, Protocol):
    """The engine inside an island, as the outer loop uses it."""

    step_count: int  # optimizer steps applied (what an outer state-less resume counts from)

    @property
    def device(self) -> torch.device:
        """Where the masters live (the outer state lives beside them)."""
        ...

    @property
    def loss_scale(self) -> float: ...

    def gathered_parameters(self) -> AbstractContextManager[None]: ...

    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters of this rank's os shard, in `shard_map().pieces` order; the outer
        step writes them in place, then calls `publish_masters`."""
        ...

    def publish_masters(self) -> None:
        """Make the parameters the model computes with from the masters written outside a step."""
        ...

    def shard_map(self) -> ShardMap:
        """Where masters, trained tensors and normed elements sit in the flat os shard: the
        ranges a fragment may cut and the norms' weights."""
        ...

    @property
    def state_names(self) -> tuple[str, ...]:
        """The names of the inner optimizer's per-element state (`moments()`'s keys once made;
        none for SGD without momentum): what `outer.optimizer_state_every` averages."""
        ...

    def moments(self) -> list[dict[str, torch.Tensor]]:
        """The inner optimizer's per-element state of each master, in `masters()` order: its
        state name -> a tensor of the master's shape (AdamW's "exp_avg" and "exp_avg_sq", an
        SGD's "momentum_buffer"; scalars such as Adam's step count left out), written in place
        when averaged across islands (`outer.optimizer_state_every`); empty before the optimizer's
        first step made it. By name, so the outer loop is the same over any inner optimizer."""
        ...

    def held_bytes(self) -> memory.StateBytes: ...

    def expected_bytes(self) -> memory.StateBytes: ...

    def expected_shard_bytes(self, fp32_copies: int) -> int:
        """The memory formula's bytes of `fp32_copies` fp32 vectors the size of this rank's os
        shard (the outer state is such vectors)."""
        ...
