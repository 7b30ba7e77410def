"""Streaming DiLoCo's fragments (arXiv 2501.18512): which elements of the rank's flat os shard
each fragment is, and at which inner steps it syncs.

The trained parameter tensors, in the engine's bucket order, are cut into F runs of consecutive
tensors, so a fragment is the same parameters on every rank whatever part of them (maybe none)
a rank's os shard holds. A fragment's elements in the flat shard are a few ranges (one, unless
padding separates its tensors), read and written through views (`Fragment`), and fragment f
syncs every H steps at offset f H / F (`due_fragments`), so a step moves one fragment.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megazpp.errors import ConfigError
from megazpp.outer import traffic
from megazpp.zero.shard_map import Range, ShardMap


def merge_ranges(ranges: list[Range]) -> list[Range]:
    """`ranges` (in order, disjoint) with touching neighbours joined: a fragment of whole
    parameter tensors is one range unless padding (a bucket's tail, ZeRO++'s alignment gaps)
    separates its tensors."""
    out: list[Range] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def range_indices(ranges: list[Range]) -> torch.Tensor:
    """The element indices of `ranges`: the form checkpoints store a fragment in (on the host on
    purpose: the checkpoint's files and the comparison on loading are the host's)."""
    if not ranges:
        return torch.zeros(0, dtype=torch.long, device="cpu")
    return torch.cat([torch.arange(a, b, device="cpu") for a, b in ranges])


@dataclass(frozen=True)
class Fragment:
    """One fragment's part of the rank's flat os shard: `ranges` of it, and the same elements
    as (master tensor index, start) per range piece inside one master (`segments`: flat start,
    flat stop, master, start in the master), so the outer step reads and writes the masters
    and the outer state in place, by views, without an index tensor or a whole-shard copy."""

    ranges: list[Range]
    segments: list[tuple[int, int, int, int]]

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def gather(self, vec: torch.Tensor) -> torch.Tensor:
        """The fragment's elements of `vec` (the flat shard's size) as one vector: a view when
        the fragment is one range, else a copy (`scatter` writes it back)."""
        if len(self.ranges) == 1:
            a, b = self.ranges[0]
            return vec[a:b]
        return torch.cat([vec[a:b] for a, b in self.ranges]) if self.ranges else vec.new_zeros(0)

    def scatter(self, vec: torch.Tensor, values: torch.Tensor) -> None:
        """Write a `gather`ed vector back (nothing to do for a view)."""
        if len(self.ranges) == 1:
            return
        pos = 0
        for a, b in self.ranges:
            vec[a:b].copy_(values[pos : pos + b - a])
            pos += b - a

    def masters(self, masters: list[torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, stop) in the fragment's vector and the 1-D view of the masters there."""
        pos = 0
        for a, b, m, lo in self.segments:
            yield pos, pos + b - a, masters[m].view(-1)[lo : lo + b - a]
            pos += b - a


def fragment_of(ranges: list[Range], pieces: list[Range]) -> Fragment:
    """The fragment over `ranges` of the flat shard, whose masters cover `pieces` of it (in
    order, each master one piece)."""
    merged = merge_ranges(ranges)
    return Fragment(
        merged,
        [
            (max(a, pa), min(b, pb), m, max(a, pa) - pa)
            for a, b in merged
            for m, (pa, pb) in enumerate(pieces)
            if max(a, pa) < min(b, pb)
        ],
    )


def due_fragments(inner_steps: int, sync_every: int, count: int) -> list[int]:
    """The fragments synced after inner step `inner_steps` (counted from 1): fragment f every H
    steps at offset f H / F, so F <= H fragments never share a step (Streaming DiLoCo)."""
    offsets = [f * sync_every // count for f in range(count)]
    return [f for f, off in enumerate(offsets) if inner_steps >= max(off, 1) and (inner_steps - off) % sync_every == 0]


def first_sync_after(iteration: int, sync_every: int, overlap: int) -> int:
    """The iteration at which the first whole-model outer sync after `iteration` lands: fragment
    0's first start after it (`due_fragments`: at the multiples of H, the inner steps counting
    on from the iteration the islands start at, `outer.start_iter` or a warm start's checkpoint)
    plus the overlap; from iteration 0, H + tau."""
    return (iteration // sync_every + 1) * sync_every + overlap


def last_landed(inner_steps: int, sync_every: int, count: int, overlap: int) -> list[int | None]:
    """Per fragment, the inner step whose sync it last applied by inner step `inner_steps` (a
    sync started at s lands at s + overlap), or None when none had landed: what the outer
    snapshot, and so a two-level export, holds of each fragment. With several fragments or an
    overlap this is not `inner_steps // H * H`: fragment f syncs at offset f H / F, and an
    exchange in flight is not in the snapshot yet."""
    started = inner_steps - overlap  # the last start that has landed
    out: list[int | None] = []
    for f in range(count):
        offset = f * sync_every // count
        last = started - (started - offset) % sync_every
        out.append(last if last >= max(offset, 1) else None)
    return out


def build_fragments(shard: ShardMap, count: int) -> list[Fragment]:
    """`count` runs of consecutive trained tensors (as even in count as they divide), so a
    fragment is the same parameters on every rank, whatever part of them (maybe none) a
    rank's os shard holds; each as ranges of the flat shard (one, unless padding splits it)."""
    if count > len(shard.tensors):
        raise ConfigError(
            f"outer.fragments = {count}: this pipeline stage trains only {len(shard.tensors)} "
            f"parameter tensors, the units fragments are made of"
        )
    return [
        fragment_of([r for _, ranges in shard.tensors[run.start : run.stop] for r in ranges], shard.pieces)
        for run in traffic.fragment_runs(len(shard.tensors), count)
    ]


def fragment_names(shard: ShardMap, count: int) -> list[list[str]]:
    """The parameter names of each of `count` fragments."""
    return [
        [name for name, _ in shard.tensors[run.start : run.stop]]
        for run in traffic.fragment_runs(len(shard.tensors), count)
    ]
