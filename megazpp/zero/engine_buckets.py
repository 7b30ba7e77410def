"""The ZeroEngine's buckets built from a model: trainable and frozen, their norm order and the
modules that fetch them.

Why a module of its own: building is a one-time walk of the model tree into explicit per-bucket
state (`bucket.Bucket`), with nothing of the step in it; the engine (`zero_engine.py`) keeps
only what runs each step. Every function here is a pure function of the model and the engine's
settings, so each bucket's contents follow from its arguments alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megazpp.errors import ConfigError
from megazpp.zero.bucket import Bucket, MasterPiece
from megazpp.zero.collectives import ZeroGroups
from megazpp.zero.frozen import frozen_buckets, frozen_refusal
from megazpp.zero.layout import BucketLayout
from megazpp.zero.options import ZeroOptions
from megazpp.zero.paths import CommPaths
from megazpp.zero.strategy import Level
from megazpp.zero.units import bucket_bound, engine_groups
from megazpp.zero.zeropp import ZeroPP


def trainable_buckets(
    model: nn.Module,
    options: ZeroOptions,
    groups: ZeroGroups,
    zeropp: ZeroPP,
    dp_index: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    counts_in_norm: Callable[[str, nn.Parameter], bool],
    paths: CommPaths,
) -> list[Bucket]:
    """One bucket per fetch group (or gradient bucket, p = N) of the trainable parameters, then
    the persistent ones kept whole: the parameter shard at level p in `dtypes[0]` (the model
    dtype), the gradient accumulator at level g in `dtypes[1]` (the accumulation dtype), the fp32
    master pieces at level os taken from the model's fp32 weights, and the parts of the os shard
    this rank counts in the norm (`counts_in_norm(name, param)`)."""
    s = options.resolved
    param_dtype, accum_dtype = dtypes
    specs, whole = engine_groups(
        model,
        sharded=s.params != Level.N,
        threshold=options.module_granularity_threshold,
        fetch_mode=options.fetch_groups,
        persistence=options.stage3_param_persistence_threshold,
        bucket_numel=bucket_bound(options.reduce_bucket_size, options.allgather_bucket_size),
    )
    buckets = []
    for spec, persistent in [(x, False) for x in specs] + [(x, True) for x in whole]:
        layout = BucketLayout.build(spec.params, groups.dp_size, groups.group_size, dp_index, zeropp.alignment())
        flat = layout.flatten(torch.float32)
        p_level = Level.N if persistent else s.params
        lo, hi = layout.shard_range(p_level)
        store = flat[lo:hi].to(param_dtype, copy=True)
        if p_level == Level.N:
            layout.view_params_into(store)
        os_lo, _ = layout.shard_range(s.optimizer_state)
        masters = [
            MasterPiece(a, b, decays, flat[os_lo + a : os_lo + b].clone())
            for a, b, decays in layout.decay_split(s.optimizer_state)
        ]
        keep = [counts_in_norm(n, p) for n, p in zip(layout.names, layout.params)]
        bucket = Bucket(
            spec.name,
            layout,
            spec.modules,
            store,
            flat.new_zeros(layout.shard_size(s.grads), dtype=accum_dtype),
            masters,
            layout.ranges_in_shard(s.optimizer_state, keep),
            persistent,
        )
        paths.init_bucket(bucket)
        buckets.append(bucket)
    return buckets


def frozen_groups(
    model: nn.Module, options: ZeroOptions, groups: ZeroGroups, zeropp: ZeroPP, dp_index: int, dtype: torch.dtype
) -> list[Bucket]:
    """Buckets of the frozen parameters (`frozen.py`), held at level p; none when every
    parameter trains. The frozen rule is refused here too: the config check narrows the
    strategy by it (`config.checks`), but a library caller may build the engine without it."""
    if all(p.requires_grad for p in model.parameters()):
        return []
    s = options.resolved
    refusal = frozen_refusal(s, zeropp.qwz, zeropp.hpz, options.stage3_param_persistence_threshold)
    if refusal is not None:
        raise ConfigError(refusal)
    return frozen_buckets(
        model,
        s,
        groups.dp_size,
        groups.group_size,
        dp_index,
        dtype,
        options.module_granularity_threshold,
        options.fetch_groups,
        bucket_bound(options.reduce_bucket_size, options.allgather_bucket_size),
    )


def norm_order(model: nn.Module, buckets: list[Bucket]) -> list[tuple[int, int, int]]:
    """(bucket, start, end) of each os-shard part in the global norm, in the model's parameter
    order: the norm sums per-tensor squares, and a sum's rounding depends on its order, so one
    rank takes LocalEngine's arithmetic exactly on every CPU (the buckets' own order, weights
    before norms, matched it only on some vector widths)."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return [
        (k, lo, hi)
        for _, k, lo, hi in sorted(
            (position[id(b.layout.params[j])], k, lo, hi) for k, b in enumerate(buckets) for j, lo, hi in b.norm_ranges
        )
    ]


def unit_modules(model: nn.Module, fetched: list[Bucket]) -> dict[int, list[nn.Module]]:
    """Each fetched group's unit roots plus any module elsewhere that registers one of its
    parameters (a tied output layer), so every user of a parameter gathers it first."""
    owner = {id(p): b for b in fetched for p in b.layout.params}
    modules: dict[int, list[nn.Module]] = {id(b): list(b.modules) for b in fetched}
    subtree = {id(b): {id(m) for root in b.modules for m in root.modules()} for b in fetched}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            b = owner.get(id(p))
            if b is not None and id(module) not in subtree[id(b)] and module not in modules[id(b)]:
                modules[id(b)].append(module)
    return modules


def unit_parents(model: nn.Module, fetched: list[Bucket]) -> list[tuple[nn.Module, list[tuple[nn.Module, Bucket]]]]:
    """Modules whose direct children are unit roots, with those children and their groups."""
    group_of = {id(m): b for b in fetched for m in b.modules}
    out = []
    for module in model.modules():
        children = [(c, group_of[id(c)]) for c in module.children() if id(c) in group_of]
        if children:
            out.append((module, children))
    return out
