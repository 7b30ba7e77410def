"""The only module that calls torch.distributed collectives and point-to-point ops.

Why one choke point: every byte that moves between ranks is counted here (see `counter`),
per operation, per purpose tag and per link class (intra-node / inter-node), so
communication volume is a measured, tested number rather than a belief.

Byte convention (docs/arch/parallel.md): a rank counts the bytes the backend in use puts on
the links for it, filed intra- or inter-node, by the one formula the traffic formulas and the
planner also use (`megazpp.parallel.wire`). On gloo, rings in group-rank order: each member
counts an equal share of the ring's hops, by the nodes they join, and a reduce-scatter is the
all-reduce gloo runs for it; all_to_all, broadcast (a binomial tree on gloo) and recv count
what comes from the sending member. On other backends (NCCL) the volume model of the ZeRO
papers: the logical payload from each other member (N / k per member for a gather or scatter,
2 N / k for an all-reduce). Summed over ranks, each byte on a link is counted once.

Without an initialised process group every operation is the local identity of a world of
one, so single-process code runs the same code path.

CUDA tensors over gloo (several ranks sharing a GPU, `megazpp.parallel.device`): gloo's
all-reduce, broadcast, all-gather (list and into-tensor), reduce-scatter-tensor (an all-reduce
of a clone) and all-to-all copy CUDA tensors through pinned host memory on a side stream, and
their `wait()` orders the caller's stream after the copy back. Its send / recv hand the
tensor's data pointer to the transport as host memory, with no device check, and its
coalesced all-gather does the same; so point-to-point operations on CUDA tensors are staged
through host copies here (`_host_staged`), and the coalesced forms are never called.

Failures (a peer that died, the process group's timeout, `--distributed-timeout-minutes`)
are re-raised as `CommunicationError` naming the operation, its tag and this rank, also
when they surface at an asynchronous handle's `wait()`: "all_reduce (tag zero/grad_norm) on
rank 3 failed" tells an operator where a job stopped, a bare gloo error does not.
"""

from __future__ import annotations

import functools
import os
import pickle
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group starts, on purpose: this torch module binds the default
# group as its functions' default argument when it is first imported. Imported later (torch
# does, through torch.distributed.fsdp, while an engine is built), it holds the default group
# past destroy_process_group, and with it gloo's worker threads until the interpreter exits
# (local_ranks.release_process_groups says why that aborts a finished run).
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed import ProcessGroup

from megazpp.errors import TopologyError
from megazpp.parallel import wire
from megazpp.parallel.counter import CONVENTION, counter, write_json_atomic
from megazpp.parallel.work import Done, Then, named_failures

ReduceOp = dist.ReduceOp
SUM = dist.ReduceOp.SUM
P2POp = dist.P2POp

# Operations this backend run refuses natively; filled on the first refusal, or by tests that
# force the emulated path so it stays exercised on a torch whose gloo has every operation.
_EMULATED: set[str] = set()
_ranks_per_node: int | None = None
# Weak keys: a cached strong reference would keep a ProcessGroup alive past
# destroy_process_group, and its destructor then aborts the process at exit.
_group_ranks: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record_from_peers(op: str, tag: str | None, group: ProcessGroup | None, per_peer: Sequence[int] | int) -> None:
    """Record `per_peer` bytes received from each member (an int means the same from each)."""
    ranks = group_ranks(group)
    me = dist.get_rank()
    if isinstance(per_peer, int):
        per_peer = [per_peer] * len(ranks)
    my_node = node_of(me)
    intra = inter = 0
    for peer, nbytes in zip(ranks, per_peer):
        if peer == me:
            continue
        if node_of(peer) == my_node:
            intra += nbytes
        else:
            inter += nbytes
    counter.record(op, tag or op, intra, inter)


def _shape(group: ProcessGroup | None) -> wire.GroupShape:
    return wire.GroupShape.of(group_ranks(group), dist.get_rank(), ranks_per_node(), dist.get_backend(group))


def _record_chunks(op: str, tag: str | None, group: ProcessGroup | None, chunk: int) -> None:
    """An all_gather / reduce_scatter / all_to_all of `chunk` bytes per member (`wire.chunk_bytes`)."""
    counter.record(op, tag or op, *wire.chunk_bytes(op, _shape(group), chunk))


def _record_all_reduce(tag: str | None, group: ProcessGroup | None, nbytes: int) -> None:
    counter.record("all_reduce", tag or "all_reduce", *wire.all_reduce_bytes(nbytes, _shape(group)))


def _native(name: str, call: Any) -> Any:
    """Run a native collective; remember a backend refusal so the caller can emulate.

    A backend refuses an unsupported operation before any byte moves, on every rank alike,
    so falling back after the refusal cannot leave ranks mismatched.
    """
    try:
        return call()
    except (RuntimeError, NotImplementedError) as err:
        text = str(err).lower()
        if "support" not in text and "implement" not in text:
            raise
        _EMULATED.add(name)
        return None


@named_failures("all_reduce")
def all_reduce(
    t: torch.Tensor, op: Any = SUM, group: ProcessGroup | None = None, async_op: bool = False, tag: str | None = None
) -> Any:
    if not dist.is_initialized():
        return Done() if async_op else None
    _record_all_reduce(tag, group, _nbytes(t))
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def _all_gather_native(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)


def _all_gather_emulated(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool) -> Any:
    """all_gather into a list of views of `out`: same wire bytes as the native operation."""
    parts = list(out.view(-1).chunk(group_size(group)))
    work = dist.all_gather(parts, inp.reshape(-1).contiguous(), group=group, async_op=async_op)
    return work if async_op else None


@named_failures("all_gather_into_tensor")
def all_gather_into_parts(
    parts: Sequence[torch.Tensor],
    inp: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Any:
    """Member r's `inp` into `parts[r]`, counted as `all_gather_into_tensor` (the same bytes).

    Why: a caller whose buffer is not in group-rank order (ZeRO's flat DP gather, whose layout
    is PaRO-group-major) names where each member's piece goes, and saves the staged copy and the
    permuting copy after it; the backend writes each piece in place of its own chunking."""
    if not dist.is_initialized():
        parts[0].copy_(inp.reshape(parts[0].shape))
        return Done() if async_op else None
    if len(parts) != group_size(group) or any(p.numel() != inp.numel() for p in parts):
        raise ValueError(
            f"all_gather_into_parts: {len(parts)} parts of {[p.numel() for p in parts[:2]]}... "
            f"elements, expected {group_size(group)} of {inp.numel()}"
        )
    _record_chunks("all_gather", tag, group, _nbytes(inp))
    work = dist.all_gather(list(parts), inp.reshape(-1).contiguous(), group=group, async_op=async_op)
    return work if async_op else None


@named_failures("all_gather_into_tensor")
def all_gather_into_tensor(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Any:
    """Concatenate every member's `inp` along dim 0 into `out` (out = k * inp)."""
    if not dist.is_initialized():
        out.copy_(inp.reshape(out.shape))
        return Done() if async_op else None
    if out.numel() != inp.numel() * group_size(group):
        raise ValueError(
            f"all_gather_into_tensor: output has {out.numel()} elements, expected {group_size(group)} x {inp.numel()}"
        )
    _record_chunks("all_gather", tag, group, _nbytes(inp))
    if "all_gather" not in _EMULATED:
        work = _native("all_gather", lambda: _all_gather_native(out, inp, group, async_op))
        if "all_gather" not in _EMULATED:
            return work
    return _all_gather_emulated(out, inp, group, async_op)


def _reduce_scatter_native(
    out: torch.Tensor, inp: torch.Tensor, op: Any, group: ProcessGroup | None, async_op: bool
) -> Any:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, inp, op=op, group=group, async_op=async_op)


def _reduce_scatter_emulated(
    out: torch.Tensor, inp: torch.Tensor, op: Any, group: ProcessGroup | None, async_op: bool
) -> Any:
    """All-reduce a copy of the input, keep this rank's chunk: twice the native wire bytes."""
    full = inp.detach().clone()
    mine = group_rank(group)

    def finish() -> None:
        out.copy_(full.view(-1).chunk(group_size(group))[mine].view(out.shape))

    work = dist.all_reduce(full, op=op, group=group, async_op=async_op)
    if async_op:
        return Then(work, finish)
    finish()
    return None


@named_failures("reduce_scatter_tensor")
def reduce_scatter_tensor(
    out: torch.Tensor,
    inp: torch.Tensor,
    op: Any = SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Any:
    """Reduce `inp` over the group; member i keeps chunk i (along dim 0) in `out`."""
    if not dist.is_initialized():
        out.copy_(inp.reshape(out.shape))
        return Done() if async_op else None
    if inp.numel() != out.numel() * group_size(group):
        raise ValueError(
            f"reduce_scatter_tensor: input has {inp.numel()} elements, expected {group_size(group)} x {out.numel()}"
        )
    _record_chunks("reduce_scatter", tag, group, _nbytes(out))
    if "reduce_scatter" not in _EMULATED:
        work = _native("reduce_scatter", lambda: _reduce_scatter_native(out, inp, op, group, async_op))
        if "reduce_scatter" not in _EMULATED:
            return work
    return _reduce_scatter_emulated(out, inp, op, group, async_op)


class _Kept:
    """The work of `reduce_scatter_parts` with its result: `wait()` gives the reduced part."""

    def __init__(self, work: Any, result: torch.Tensor) -> None:
        self._work, self.result = work, result

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()


@named_failures("reduce_scatter_tensor")
def reduce_scatter_parts(
    t: torch.Tensor,
    parts: Sequence[torch.Tensor],
    op: Any = SUM,
    group: ProcessGroup | None = None,
    tag: str | None = None,
) -> _Kept:
    """Reduce `t` over the group, asynchronously; member r keeps `parts[r]` (views of `t` that
    tile it), reduced in place. Counted as `reduce_scatter_tensor`. The caller gives `t` up:
    what lies outside its own part is left undefined.

    Why: gloo has no reduce-scatter of its own; its `reduce_scatter_tensor` clones the input,
    all-reduces the clone and copies a chunk out, and its work never reports completion. Given
    a buffer the caller no longer needs, the all-reduce runs on it in place: the same bytes on
    the wire, no clone, no copy, no fresh pages to fault in, and a completion a progress point
    can see. Other backends reduce-scatter natively, in place when the parts are in group
    order (NCCL's in-place form: the output is the member's own chunk of the input)."""
    k = group_size(group)
    if len(parts) != k or sum(p.numel() for p in parts) != t.numel():
        raise ValueError(
            f"reduce_scatter_parts: {len(parts)} parts covering {sum(p.numel() for p in parts)} "
            f"elements, expected {k} covering {t.numel()}"
        )
    if not dist.is_initialized():
        return _Kept(Done(), parts[0])
    mine = parts[group_rank(group)]
    _record_chunks("reduce_scatter", tag, group, _nbytes(mine))
    if dist.get_backend(group) == "gloo":
        return _Kept(dist.all_reduce(t, op=op, group=group, async_op=True), mine)
    in_order = all(p.data_ptr() == t.data_ptr() + i * mine.numel() * t.element_size() for i, p in enumerate(parts))
    src = t.view(-1) if in_order else torch.cat([p.reshape(-1) for p in parts])
    return _Kept(_reduce_scatter_native(mine.view(-1), src, op, group, async_op=True), mine)


def _all_to_all_emulated(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: ProcessGroup | None,
    async_op: bool,
) -> Any:
    """One batched isend/irecv per peer: the same wire bytes as the native operation."""
    ranks, mine = group_ranks(group), group_rank(group)
    outs = out.split(out_splits)
    ins = inp.split(in_splits)
    outs[mine].copy_(ins[mine])
    ops = []
    for j, peer in enumerate(ranks):
        if j != mine:
            ops.append(dist.P2POp(dist.isend, ins[j].contiguous(), peer, group))
            ops.append(dist.P2POp(dist.irecv, outs[j], peer, group))
    works = _start_p2p(ops) if ops else []
    if async_op:
        return Then(Done(), lambda: [w.wait() for w in works])
    for w in works:
        w.wait()
    return None


@named_failures("all_to_all_single")
def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Any:
    """Member j receives slice j (along dim 0) of every member's `inp`, in member order."""
    if not dist.is_initialized():
        out.copy_(inp.reshape(out.shape))
        return Done() if async_op else None
    k = group_size(group)
    row = _nbytes(out) // max(out.shape[0], 1) if out.dim() else out.element_size()
    if output_split_sizes is None:
        if out.shape[0] % k:
            raise ValueError(f"all_to_all_single: dim 0 of size {out.shape[0]} does not divide by {k}")
        _record_chunks("all_to_all", tag, group, _nbytes(out) // k)
    else:
        _record_from_peers("all_to_all", tag, group, [s * row for s in output_split_sizes])
    if "all_to_all" not in _EMULATED:
        work = _native(
            "all_to_all",
            lambda: dist.all_to_all_single(
                out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op
            ),
        )
        if "all_to_all" not in _EMULATED:
            return work
    out_splits = output_split_sizes or [out.shape[0] // k] * k
    in_splits = input_split_sizes or [inp.shape[0] // k] * k
    return _all_to_all_emulated(out, inp, out_splits, in_splits, group, async_op)


@named_failures("broadcast")
def broadcast(
    t: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False, tag: str | None = None
) -> Any:
    """`src` is a global rank, as in torch.distributed."""
    if not dist.is_initialized():
        return Done() if async_op else None
    if dist.get_rank() != src:
        ranks = group_ranks(group)
        sender = src
        if dist.get_backend(group) in wire.RING_BACKENDS:  # gloo: from my parent in its binomial tree
            sender = ranks[wire.broadcast_parent(ranks.index(dist.get_rank()), ranks.index(src), len(ranks))]
        _record_from_peers("broadcast", tag, group, [_nbytes(t) if p == sender else 0 for p in ranks])
    else:
        counter.record("broadcast", tag or "broadcast", 0, 0)
    return dist.broadcast(t, src=src, group=group, async_op=async_op)


def _record_recv(tag: str | None, src: int, nbytes: int) -> None:
    if node_of(src) == node_of(dist.get_rank()):
        counter.record("p2p", tag or "p2p", nbytes, 0)
    else:
        counter.record("p2p", tag or "p2p", 0, nbytes)


def _host_staged(t: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether a point-to-point tensor must travel through a host copy: a device tensor on gloo
    (whose send / recv would read device memory as host memory), or any tensor once a test
    forced the staged path (`"p2p"` in `_EMULATED`) so it stays exercised on CPU ranks."""
    if dist.get_backend(group) != "gloo":
        return False
    return t.device.type != "cpu" or "p2p" in _EMULATED


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of `t` (on CUDA: after the work queued on `t`'s stream)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _start_p2p(ops: list[P2POp]) -> list[Any]:
    """`dist.batch_isend_irecv` with device tensors on gloo staged through host copies: sends go
    from a copy made now; a receive lands in a host buffer, copied into its tensor when its
    work's `wait()` returns (`Then`), so it is complete exactly when the native one would be."""
    staged: list[P2POp] = []
    finish: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for op in ops:
        if not _host_staged(op.tensor, op.group):
            staged.append(op)
            finish.append(None)
        elif op.op is dist.irecv:
            host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
            staged.append(dist.P2POp(dist.irecv, host, op.peer, op.group))
            finish.append((op.tensor, host))
        else:
            staged.append(dist.P2POp(dist.isend, _host_copy(op.tensor), op.peer, op.group))
            finish.append(None)
    works = dist.batch_isend_irecv(staged)
    return [w if pair is None else Then(w, functools.partial(_copy_into, *pair)) for w, pair in zip(works, finish)]


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


@named_failures("send")
def send(t: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: str | None = None) -> None:
    """Blocking send to global rank `dst`; the receiver does the counting."""
    dist.send(_host_copy(t) if _host_staged(t, group) else t, dst, group=group)


@named_failures("recv")
def recv(t: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: str | None = None) -> None:
    """Blocking receive from global rank `src`."""
    _record_recv(tag, src, _nbytes(t))
    if _host_staged(t, group):
        host = torch.empty(t.shape, dtype=t.dtype)
        dist.recv(host, src, group=group)
        t.copy_(host)
    else:
        dist.recv(t, src, group=group)


def send_op(t: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> P2POp:
    return dist.P2POp(dist.isend, t, dst, group)


def recv_op(t: torch.Tensor, src: int, group: ProcessGroup | None = None) -> P2POp:
    return dist.P2POp(dist.irecv, t, src, group)


@named_failures("batch_isend_irecv")
def batch_isend_irecv(ops: list[P2POp], tag: str | None = None) -> list[Any]:
    """Start all `ops` (from `send_op` / `recv_op`); returns their waitables."""
    if not ops:
        return []
    for op in ops:
        if op.op is dist.irecv:
            _record_recv(tag, op.peer, _nbytes(op.tensor))
    return _start_p2p(ops)


@named_failures("all_gather_object")
def all_gather_object(obj: Any, group: ProcessGroup | None = None, tag: str | None = None) -> list[Any]:
    """Every member's picklable `obj`, in group-rank order (counted as its pickled size)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    sizes = [len(pickle.dumps(o)) for o in out]
    if dist.get_backend(group) in wire.RING_BACKENDS:  # torch gathers the sizes, then each object padded to the largest
        counter.record(
            "all_gather_object",
            tag or "all_gather_object",
            *wire.chunk_bytes("all_gather", _shape(group), max(sizes) + 8),
        )
    else:
        _record_from_peers("all_gather_object", tag, group, sizes)
    return out


@named_failures("barrier")
def barrier(group: ProcessGroup | None = None, tag: str | None = None) -> None:
    if not dist.is_initialized():
        return
    counter.record("barrier", tag or "barrier", 0, 0)
    dist.barrier(group=group)


def write_world_report(path: str, group: ProcessGroup | None = None) -> dict[str, Any]:
    """Collective: gather every rank's run totals of `counter`; rank 0 writes them with world
    sums. The totals are snapshotted before the gather, so the report does not count itself.
    Returns the report on every rank."""
    mine = counter.run_totals()
    per_rank = all_gather_object(mine, group=group, tag="report/gather")
    report = {
        "convention": CONVENTION,
        "steps": counter.steps,
        "world": {"intra": sum(r["intra"] for r in per_rank), "inter": sum(r["inter"] for r in per_rank)},
        "per_rank": per_rank,
    }
    if group_rank(group) == 0:
        write_json_atomic(path, report)
    return report
