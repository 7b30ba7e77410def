"""What a ZeRO engine should hold and move, by the formulas, and what it holds, counted.

Why apart from the engine: these apply `memory` and `traffic` (the formulas the planner shares)
to one engine's layout, for the tests that assert bytes and calls equal the formulas and for the
outer optimizer's own accounting; the engine's step does not use them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megazpp.optim.options import OptimizerOptions
from megazpp.parallel.topology import Topology
from megazpp.parallel.wire import GroupShape
from megazpp.zero import memory, sequences, traffic
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import ZeroGroups
from megazpp.zero.frozen import frozen_fetch_parts, frozen_param_bytes
from megazpp.zero.paths import CommPaths
from megazpp.zero.strategy import Strategy
from megazpp.zero.zeropp import ZeroPP


class AccountedEngine(Protocol):
    """What of a `zero.zero_engine.ZeroEngine` the formulas read (a Protocol, so the engine imports
    this file without this file importing the engine)."""

    strategy: Strategy
    groups: ZeroGroups
    shapes: sequences.DPShapes
    hier: sequences.Hierarchy
    zeropp: ZeroPP
    topology: Topology
    buckets: list[Bucket]
    frozen: list[Bucket]
    optimizer: torch.optim.Optimizer
    optimizer_options: OptimizerOptions
    paths: CommPaths
    param_dtype: torch.dtype
    accum_dtype: torch.dtype
    persistent: int
    reused: tuple[bool, ...]
    frozen_reused: tuple[bool, ...]

    def padded_numels(self) -> list[int]: ...


def held_bytes(e: AccountedEngine) -> memory.StateBytes:
    """Model-state bytes this rank holds, counted from the engine's own tensors."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    params = sum(nbytes(b.param_store) for b in e.buckets + e.frozen)
    grads = sum(nbytes(b.grad_acc) for b in e.buckets)
    optim = 0
    for b in e.buckets:
        for m in b.masters:
            state = e.optimizer.state.get(m.param, {})
            optim += nbytes(m.param) + sum(nbytes(state[k]) for k in e.optimizer_options.state_names if k in state)
    return memory.StateBytes(params, grads, optim, e.paths.state_nbytes())


def expected_bytes(e: AccountedEngine) -> memory.StateBytes:
    plain = memory.state_bytes(
        e.strategy,
        e.padded_numels(),
        e.groups.dp_size,
        e.groups.group_size,
        e.param_dtype.itemsize,
        e.accum_dtype.itemsize,
        e.persistent,
        len(e.optimizer_options.state_names),
    )
    extra = memory.zeropp_state_bytes(
        e.padded_numels(), e.shapes, e.hier, e.zeropp, e.param_dtype.itemsize, e.strategy, e.persistent
    )
    frozen = frozen_param_bytes(
        e.strategy, [b.layout.padded for b in e.frozen], e.groups.dp_size, e.groups.group_size, e.param_dtype.itemsize
    )
    return memory.StateBytes(plain.params + frozen, plain.grads, plain.optimizer, extra)


def _model_parallel_norm_groups(e: AccountedEngine) -> list[GroupShape]:
    topo = e.topology
    return [
        GroupShape.of(ranks, topo.rank, topo.ranks_per_node, e.shapes.dp.backend)
        for ranks, size in ((topo.tp_ranks, topo.tp), (topo.pp_ranks, topo.pp))
        if size > 1
    ]


def _frozen_fetches(e: AccountedEngine, micro_batches: int) -> list[traffic.StepPart]:
    return frozen_fetch_parts(
        e.strategy,
        [b.layout.padded for b in e.frozen],
        e.shapes,
        e.hier,
        micro_batches=micro_batches,
        param_bytes=e.param_dtype.itemsize,
        reused=e.frozen_reused,
    )


def expected_step_bytes(e: AccountedEngine, micro_batches: int) -> tuple[int, int]:
    intra, inter = traffic.step_bytes(
        e.strategy,
        e.padded_numels(),
        e.shapes,
        e.hier,
        micro_batches=micro_batches,
        param_bytes=e.param_dtype.itemsize,
        accum_bytes=e.accum_dtype.itemsize,
        extra_norm_groups=_model_parallel_norm_groups(e),
        zeropp=e.zeropp,
        reused=e.reused,
        persistent=e.persistent,
        exact_ranges=[b.layout.vector_ranges() for b in e.buckets],
    )
    for part in _frozen_fetches(e, micro_batches):
        a, b = part.bytes_once(e.shapes)
        intra, inter = intra + part.times * a, inter + part.times * b
    return intra, inter


def expected_step_calls(e: AccountedEngine, micro_batches: int) -> int:
    calls = traffic.step_calls(
        e.strategy,
        e.padded_numels(),
        e.shapes,
        e.hier,
        micro_batches=micro_batches,
        extra_norm_groups=_model_parallel_norm_groups(e),
        zeropp=e.zeropp,
        reused=e.reused,
        persistent=e.persistent,
    )
    return calls + sum(part.times * part.calls_once(e.shapes) for part in _frozen_fetches(e, micro_batches))
