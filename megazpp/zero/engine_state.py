"""A ZeroEngine's checkpoint state: save it, restore it bit for bit, or cut a full
per-parameter state (another DP size or strategy) by this engine's layout.

Why apart from the engine: the engine runs a step; this file knows how its buckets, masters
and optimizer state (AdamW's moments, SGD's momentum buffer) are laid out on disk and how a
reader places them without an engine.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from megazpp.errors import CheckpointError
from megazpp.optim.loss_scaler import LossScaler
from megazpp.optim.optimizer import OPTIMIZER_NAME_KEY, check_same_optimizer
from megazpp.optim.options import OptimizerOptions
from megazpp.parallel.topology import Topology
from megazpp.state import StateDict
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import ZeroGroups
from megazpp.zero.frozen import FROZEN_SAVED_KEY
from megazpp.zero.param_fetch import ParamFetcher
from megazpp.zero.paths import CommPaths
from megazpp.zero.strategy import Level, Strategy

log = logging.getLogger(__name__)


class CheckpointedEngine(Protocol):
    """What of a `zero.zero_engine.ZeroEngine` its checkpoint state reads and restores (a Protocol,
    so the engine can import this file without this file importing the engine)."""

    strategy: Strategy
    groups: ZeroGroups
    topology: Topology
    step_count: int
    buckets: list[Bucket]
    frozen: list[Bucket]
    optimizer: torch.optim.Optimizer
    optimizer_options: OptimizerOptions
    scaler: LossScaler | None
    fetcher: ParamFetcher | None
    param_dtype: torch.dtype
    paths: CommPaths


# `load_state_dict` input holding full tensors by parameter name (params, fp32 masters, the
# optimizer's state tensors) rather than one rank's shards: what resharding across DP sizes /
# strategies feeds in
FULL_STATE_FORMAT = "megazpp.zero.full_state.v1"


def held_buckets(engine: CheckpointedEngine, frozen: bool) -> list[Bucket]:
    """The buckets a state of `engine` holds, in its order: the trainable ones, then (with
    `frozen`; an adapters-only checkpoint leaves them out) the frozen ones."""
    return engine.buckets + engine.frozen if frozen else engine.buckets


def engine_state_dict(engine: CheckpointedEngine, frozen: bool = True) -> StateDict:
    """This rank's state, plus what a reader needs to place it without this engine: each
    bucket's layout (global names, shapes, flat offsets) and the [start, end) ranges of
    the bucket's unpermuted flat buffer that each saved tensor covers, and which (bucket,
    master piece) each optimizer state entry belongs to (`optimizer_slots`). Without `frozen` the
    frozen buckets are left out (an adapters-only checkpoint)."""
    held = held_buckets(engine, frozen)
    return {
        "strategy": engine.strategy.name,
        "dp": engine.groups.dp_size,
        "k": engine.groups.group_size,
        "dp_rank": engine.topology.dp_rank,
        "step_count": engine.step_count,
        FROZEN_SAVED_KEY: frozen,
        "buckets": [{**b.state_dict(), **_placement(engine, b)} for b in held],
        "optimizer": engine.optimizer.state_dict(),
        OPTIMIZER_NAME_KEY: engine.optimizer_options.name,
        "optimizer_slots": [list(slot) for slot in _optimizer_slots(engine)],
        "loss_scaler": engine.scaler.state_dict() if engine.scaler else None,
    }


def _placement(engine: CheckpointedEngine, b: Bucket) -> StateDict:
    s = engine.strategy
    os_lo, _ = b.layout.shard_range(s.optimizer_state)
    return {
        "layout": b.layout.describe(),
        "ranges": {
            "param_store": list(b.layout.shard_range(Level.N if b.persistent else s.params)),
            "grad_acc": list(b.layout.shard_range(s.grads)),
            "masters": [[os_lo + m.start, os_lo + m.end] for m in b.masters],
        },
    }


def _optimizer_slots(engine: CheckpointedEngine) -> list[tuple[int, int]]:
    """(bucket index, master index) of each optimizer parameter, in the optimizer's order."""
    slots = {id(m.param): (i, j) for i, b in enumerate(engine.buckets) for j, m in enumerate(b.masters)}
    return [slots[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]


def load_engine_state(engine: CheckpointedEngine, state: StateDict) -> None:
    """This rank's own saved state (same layout: restored bit for bit), or a full per-
    parameter state (`FULL_STATE_FORMAT`, made by `megazpp.checkpoint.reshard` from every rank
    file of a checkpoint saved under another DP size or strategy), cut by this layout."""
    check_same_optimizer(state.get(OPTIMIZER_NAME_KEY), engine.optimizer_options, "ZeRO checkpoint")
    if engine.fetcher is not None:
        engine.fetcher.release_all()
    if state.get("format") == FULL_STATE_FORMAT:
        _load_full_state(engine, state)
        return
    mine = (engine.strategy.name, engine.groups.dp_size, engine.groups.group_size, engine.topology.dp_rank)
    theirs = (state.get("strategy"), state.get("dp"), state.get("k"), state.get("dp_rank"))
    if mine != theirs:
        raise CheckpointError(
            f"ZeRO checkpoint was written for (strategy, dp, paro group, dp rank) "
            f"= {theirs}, this run is {mine}; a checkpoint of another layout "
            f"resumes through megazpp.checkpoint.reshard"
        )
    # without its frozen buckets: they hold the base the model was built with, never updated
    held = held_buckets(engine, state.get(FROZEN_SAVED_KEY, True))
    if len(state["buckets"]) != len(held):
        raise CheckpointError(
            f"ZeRO checkpoint has {len(state['buckets'])} buckets, the model "
            f"here has {len(held)} (trainable and frozen)"
        )
    for b, saved in zip(held, state["buckets"]):
        if "layout" in saved and saved["layout"] != b.layout.describe():
            raise CheckpointError(
                f"ZeRO checkpoint bucket {saved['name']} was laid out differently "
                f"(parameters, padding or ZeRO++ alignment); it resumes through "
                f"megazpp.checkpoint.reshard"
            )
        b.load_state_dict(saved)
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.step_count = state["step_count"]
    _load_scaler(engine, state)
    engine.paths.params_replaced()


def _load_scaler(engine: CheckpointedEngine, state: StateDict) -> None:
    if (engine.scaler is None) != (state.get("loss_scaler") is None):
        raise CheckpointError("ZeRO checkpoint was saved with a different fp16 loss-scaling setting")
    if engine.scaler is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])


def _flat(b: Bucket, tensors: dict[str, torch.Tensor], what: str, dtype: torch.dtype) -> torch.Tensor:
    """`tensors` (full, by parameter name) laid out as `b`'s padded flat buffer."""
    flat = torch.zeros(b.layout.padded, dtype=dtype, device=b.param_store.device)
    for name, off, shape in zip(b.layout.names, b.layout.offsets, b.layout.shapes):
        t = tensors.get(name)
        if t is None or tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"resharded state: {what} of {name!r} is "
                f"{'missing' if t is None else tuple(t.shape)}, expected {tuple(shape)}"
            )
        flat[off : off + shape.numel()].copy_(t.reshape(-1))
    return flat


def _load_full_state(engine: CheckpointedEngine, state: StateDict) -> None:
    """Cut full per-parameter tensors by this engine's layout. LoCo's error buffers are in
    the coordinates of the layout that wrote them and are zeroed (see docs/arch/interop.md)."""
    s = engine.strategy
    kinds = [k for k in engine.optimizer_options.state_names if state["optimizer_state"].get(k)]
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    reset = []
    with torch.no_grad():
        frozen = {id(b) for b in engine.frozen}
        for b in engine.buckets + engine.frozen:
            lo, hi = b.layout.shard_range(Level.N if b.persistent else s.params)
            b.param_store.copy_(_flat(b, state["params"], "parameter", engine.param_dtype)[lo:hi])
            if id(b) in frozen:  # parameters only
                continue
            b.grad_acc.zero_()
            os_lo, _ = b.layout.shard_range(s.optimizer_state)
            masters = _flat(b, state["masters"], "fp32 master", torch.float32)
            cut = {k: _flat(b, state["optimizer_state"][k], k, torch.float32) for k in kinds}
            step = state["optimizer_step"]
            for m in b.masters:
                a, z = os_lo + m.start, os_lo + m.end
                m.param.copy_(masters[a:z])
                if kinds:
                    per_param[id(m.param)] = {
                        **({"step": step.clone()} if step is not None else {}),
                        **{k: v[a:z].clone() for k, v in cut.items()},
                    }
            for v in b.extra_state.values():
                v.zero_()
            if b.extra_state:
                reset.append(b.name)
    if reset:
        log.warning(
            "zero: resharded from %s; LoCo error buffers of %d buckets start from zero "
            "(they are in the old layout's sender coordinates)",
            state.get("source"),
            len(reset),
        )
    template = engine.optimizer.state_dict()
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    template["state"] = {i: per_param[id(p)] for i, p in enumerate(params) if id(p) in per_param}
    engine.optimizer.load_state_dict(template)
    engine.step_count = int(state["step_count"])
    _load_scaler(engine, state)
    engine.paths.params_replaced()
