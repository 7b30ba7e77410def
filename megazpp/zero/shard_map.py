"""A rank's flat optimizer-state shard as seen from outside the engine: where each fp32 master,
each trained tensor and each element the norms count sits in it, and the engine's layout over
the data-parallel ranks.

Why apart from the buckets: the outer loop (`megazpp.outer`) cuts fragments of whole tensors out
of the masters and weighs its logged norms as the engine weighs its own; the banner and the
checkpoints compare and name the layout. They need these coordinates, not the buckets, groups
and paths that make them, so the engine hands them out through `inner_engine`'s protocols.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import ZeroGroups
from megazpp.zero.layout import LayoutRecord
from megazpp.zero.sequences import Hierarchy
from megazpp.zero.strategy import Level, Strategy, level_div
from megazpp.zero.zeropp import ZeroPP

Range = tuple[int, int]  # [start, stop) of elements of the rank's flat os shard


@dataclass(frozen=True)
class ShardMap:
    """The rank's flat os shard: its fp32 masters back to back, bucket after bucket."""

    pieces: list[Range]  # each master's place, in the order of the engine's `masters()`
    tensors: list[tuple[str, list[Range]]]  # every trained tensor in bucket order: name, its places (maybe none)
    norm_ranges: list[Range]  # the elements this rank counts in norms (TP-replicated ones on one TP rank)
    replication: int  # how many ranks of the engine's data-parallel group hold each os element


def shard_map(buckets: list[Bucket], level: Level, groups: ZeroGroups) -> ShardMap:
    """The map of the masters of `buckets`, sharded at `level` (the optimizer state's)."""
    offsets = [0]
    for b in buckets:
        offsets.append(offsets[-1] + sum(m.param.numel() for m in b.masters))
    tensors = [
        (
            b.layout.names[j],
            [
                (offsets[i] + lo, offsets[i] + hi)
                for _, lo, hi in b.layout.ranges_in_shard(level, [k == j for k in range(b.num_params)])
            ],
        )
        for i, b in enumerate(buckets)
        for j in range(b.num_params)
    ]
    return ShardMap(
        pieces=[(offsets[i] + m.start, offsets[i] + m.end) for i, b in enumerate(buckets) for m in b.masters],
        tensors=tensors,
        norm_ranges=[(offsets[i] + lo, offsets[i] + hi) for i, b in enumerate(buckets) for _, lo, hi in b.norm_ranges],
        replication=groups.dp_size // level_div(level, groups.dp_size, groups.group_size),
    )


@dataclass(frozen=True)
class ShardLayout:
    """How a ZeRO engine lays its state out over its data-parallel ranks: what the banner says
    and what a checkpoint's saved layout is compared with (`checkpoint.reshard`)."""

    strategy: Strategy
    dp: int
    group_size: int
    hier: Hierarchy
    zeropp: ZeroPP
    buckets: list[LayoutRecord]  # each trained bucket's `BucketLayout.describe()`
