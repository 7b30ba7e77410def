"""Process groups as the counted layer sees them: their members, the node of each rank, the
backend (and what it refuses natively), and how a collective's bytes are filed by link class.

Why apart from `comm`: both the collectives (`comm`) and the point-to-point operations
(`point_to_point`, which the all-to-all emulation also uses) count through these; one module
below both keeps one answer to "which node is rank r on" and one filing rule. The byte
convention itself is `comm`'s docstring and `wire`'s formulas.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megazpp.errors import TopologyError
from megazpp.parallel import wire
from megazpp.parallel.counter import counter

# Operations this backend run refuses natively; filled on the first refusal, or by tests that
# force the emulated path so it stays exercised on a torch whose gloo has every operation
# ("p2p": point-to-point through host copies, as CUDA tensors on gloo take it).
EMULATED: set[str] = set()
_ranks_per_node: int | None = None
# Weak keys: a cached strong reference would keep a ProcessGroup alive past
# destroy_process_group, and its destructor then aborts the process at exit.
_group_ranks: weakref.WeakKeyDictionary[ProcessGroup, list[int]] = weakref.WeakKeyDictionary()


def set_ranks_per_node(n: int) -> None:
    """Declare how many consecutive global ranks share a node (called by Topology)."""
    if n < 1:
        raise TopologyError(f"ranks_per_node must be >= 1, got {n}")
    global _ranks_per_node
    _ranks_per_node = n


def ranks_per_node() -> int:
    if _ranks_per_node is not None:
        return _ranks_per_node
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env:
        return int(env)
    return dist.get_world_size() if dist.is_initialized() else 1


def node_of(global_rank: int) -> int:
    return global_rank // ranks_per_node()


def group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """Global ranks of `group` in group-rank order (cached: groups live as long as the run)."""
    if group is None:
        return list(range(dist.get_world_size()))
    if group not in _group_ranks:
        _group_ranks[group] = dist.get_process_group_ranks(group)
    return _group_ranks[group]


def backend() -> str:
    """The process group's backend ("gloo", "nccl"); "none" without one (a world of one,
    where no group moves a byte)."""
    return dist.get_backend() if dist.is_initialized() else "none"


def group_size(group: ProcessGroup | None = None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None = None) -> int:
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def record_from_peers(op: str, tag: str | None, group: ProcessGroup | None, per_peer: Sequence[int] | int) -> None:
    """Record `per_peer` bytes received from each member (an int means the same from each)."""
    ranks = group_ranks(group)
    me = dist.get_rank()
    if isinstance(per_peer, int):
        per_peer = [per_peer] * len(ranks)
    my_node = node_of(me)
    intra = inter = 0
    for peer, n in zip(ranks, per_peer):
        if peer == me:
            continue
        if node_of(peer) == my_node:
            intra += n
        else:
            inter += n
    counter.record(op, tag or op, intra, inter)


def shape(group: ProcessGroup | None) -> wire.GroupShape:
    return wire.GroupShape.of(group_ranks(group), dist.get_rank(), ranks_per_node(), dist.get_backend(group))


def record_chunks(op: str, tag: str | None, group: ProcessGroup | None, chunk: int) -> None:
    """An all_gather / reduce_scatter / all_to_all of `chunk` bytes per member (`wire.chunk_bytes`)."""
    counter.record(op, tag or op, *wire.chunk_bytes(op, shape(group), chunk))


def record_all_reduce(tag: str | None, group: ProcessGroup | None, n: int) -> None:
    counter.record("all_reduce", tag or "all_reduce", *wire.all_reduce_bytes(n, shape(group)))


def record_recv(tag: str | None, src: int, n: int) -> None:
    """A point-to-point receive of `n` bytes from global rank `src` (the receiver counts)."""
    if node_of(src) == node_of(dist.get_rank()):
        counter.record("p2p", tag or "p2p", n, 0)
    else:
        counter.record("p2p", tag or "p2p", 0, n)
