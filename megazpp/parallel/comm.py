"""The only layer that calls torch.distributed collectives and point-to-point ops.

Why one choke point: every byte that moves between ranks is counted here (see `counter`),
per operation, per purpose tag and per link class (intra-node / inter-node), so
communication volume is a measured, tested number rather than a belief. This module holds the
collectives and is the one name callers use; the point-to-point operations (`point_to_point`)
and the groups' members and nodes (`groups`) are its parts, re-exported here.

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

Handles: every collective returns a `work.Work` (its `wait()` gives nothing a caller uses):
with `async_op=True` the backend's handle, still running; without, a finished one (`Done`),
after the operation has completed. One return type, so no caller needs to tell them apart.

CUDA tensors over gloo (several ranks sharing a GPU, `megazpp.parallel.device`): gloo's
all-reduce, broadcast, all-gather (list and into-tensor), reduce-scatter-tensor (an all-reduce
of a clone) and all-to-all copy CUDA tensors through pinned host memory on a side stream, and
their `wait()` orders the caller's stream after the copy back. Its send / recv hand the
tensor's data pointer to the transport as host memory, with no device check, and its
coalesced all-gather does the same; so point-to-point operations on CUDA tensors are staged
through host copies (`point_to_point`), and the coalesced forms are never called.

Failures (a peer that died, the process group's timeout, `--distributed-timeout-minutes`)
are re-raised as `CommunicationError` naming the operation, its tag and this rank, also
when they surface at an asynchronous handle's `wait()`: "all_reduce (tag zero/grad_norm) on
rank 3 failed" tells an operator where a job stopped, a bare gloo error does not.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias, TypeVar

import torch
import torch.distributed as dist

# Imported before any process group starts, on purpose: this torch module binds the default
# group as its functions' default argument when it is first imported. Imported later (torch
# does, through torch.distributed.fsdp, while an engine is built), it holds the default group
# past destroy_process_group, and with it gloo's worker threads until the interpreter exits
# (local_ranks.release_process_groups says why that aborts a finished run).
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed import ProcessGroup

from megazpp.parallel import groups, point_to_point, wire
from megazpp.parallel.counter import CONVENTION, counter, write_json_atomic
from megazpp.parallel.groups import (
    EMULATED,
    group_ranks,
    nbytes,
    record_all_reduce,
    record_chunks,
    record_from_peers,
    shape,
)
from megazpp.parallel.point_to_point import start_p2p
from megazpp.parallel.work import Done, Then, Work, named_failures

ReduceOp = dist.ReduceOp
SUM = dist.ReduceOp.SUM
P2POp = dist.P2POp
# the parts' public names, so that callers name one counted layer
set_ranks_per_node, ranks_per_node, node_of = groups.set_ranks_per_node, groups.ranks_per_node, groups.node_of
backend, group_size, group_rank = groups.backend, groups.group_size, groups.group_rank
send, recv, send_op, recv_op = point_to_point.send, point_to_point.recv, point_to_point.send_op, point_to_point.recv_op
batch_isend_irecv = point_to_point.batch_isend_irecv
Op: TypeAlias = dist.ReduceOp.RedOpType
Group: TypeAlias = ProcessGroup | None
_W = TypeVar("_W")


def _handle(work: Work[object] | None) -> Work[object]:
    """A backend call's result as a handle: its own work when it ran asynchronously, a finished
    one when it returned None (it ran to completion before returning)."""
    return Done(None) if work is None else work


def _native_or_emulated(
    name: str, native: Callable[[], Work[object]], emulated: Callable[[], Work[object]]
) -> Work[object]:
    """Run the native collective `name`, or its emulation once the backend has refused it
    (remembered in EMULATED, so later calls go straight to the emulation).

    A backend refuses an unsupported operation before any byte moves, on every rank alike,
    so falling back after the refusal cannot leave ranks mismatched. The caller counts the
    operation's bytes once, before either runs."""
    if name not in EMULATED:
        try:
            return native()
        except (RuntimeError, NotImplementedError) as err:
            text = str(err).lower()
            if "support" not in text and "implement" not in text:
                raise
            EMULATED.add(name)
    return emulated()


@named_failures("all_reduce")
def all_reduce(
    t: torch.Tensor, op: Op = SUM, group: Group = None, async_op: bool = False, tag: str | None = None
) -> Work[object]:
    if not dist.is_initialized():
        return Done(None)
    record_all_reduce(tag, group, nbytes(t))
    return _handle(dist.all_reduce(t, op=op, group=group, async_op=async_op))


def _chunked(
    kind: Literal["all_gather", "reduce_scatter"],
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Group,
    async_op: bool,
    tag: str | None,
    native: Callable[[], Work[object]],
    emulated: Callable[[], Work[object]],
) -> Work[object]:
    """The body `all_gather_into_tensor` and `reduce_scatter_tensor` share: the identity in a
    world of one; else the whole side (all-gather's output, reduce-scatter's input) checked to be
    k chunks, one chunk's bytes counted, and the collective run (`_native_or_emulated`)."""
    if not dist.is_initialized():
        out.copy_(inp.reshape(out.shape))
        return Done(None)
    gather = kind == "all_gather"
    whole, chunk = (out, inp) if gather else (inp, out)
    if whole.numel() != chunk.numel() * group_size(group):
        name, side = ("all_gather_into_tensor", "output") if gather else ("reduce_scatter_tensor", "input")
        raise ValueError(f"{name}: {side} has {whole.numel()} elements, expected {group_size(group)} x {chunk.numel()}")
    record_chunks(kind, tag, group, nbytes(chunk))
    return _native_or_emulated(kind, native, emulated)


def _all_gather_emulated(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool) -> Work[object]:
    """all_gather into a list of views of `out`: same wire bytes as the native operation."""
    parts = list(out.view(-1).chunk(group_size(group)))
    return _handle(dist.all_gather(parts, inp.reshape(-1).contiguous(), group=group, async_op=async_op))


def _all_gather_native(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool) -> Work[object]:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _handle(gather(out, inp, group=group, async_op=async_op))


@named_failures("all_gather_into_tensor")
def all_gather_into_parts(
    parts: Sequence[torch.Tensor],
    inp: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Work[object]:
    """Member r's `inp` into `parts[r]`, counted as `all_gather_into_tensor` (the same bytes).

    Why: a caller whose buffer is not in group-rank order (ZeRO's flat DP gather, whose layout
    is PaRO-group-major) names where each member's piece goes, and saves the staged copy and the
    permuting copy after it; the backend writes each piece in place of its own chunking."""
    if not dist.is_initialized():
        parts[0].copy_(inp.reshape(parts[0].shape))
        return Done(None)
    if len(parts) != group_size(group) or any(p.numel() != inp.numel() for p in parts):
        raise ValueError(
            f"all_gather_into_parts: {len(parts)} parts of {[p.numel() for p in parts[:2]]}... "
            f"elements, expected {group_size(group)} of {inp.numel()}"
        )
    record_chunks("all_gather", tag, group, nbytes(inp))
    return _handle(dist.all_gather(list(parts), inp.reshape(-1).contiguous(), group=group, async_op=async_op))


@named_failures("all_gather_into_tensor")
def all_gather_into_tensor(
    out: torch.Tensor, inp: torch.Tensor, group: Group = None, async_op: bool = False, tag: str | None = None
) -> Work[object]:
    """Concatenate every member's `inp` along dim 0 into `out` (out = k * inp)."""
    return _chunked(
        "all_gather",
        out,
        inp,
        group,
        async_op,
        tag,
        lambda: _all_gather_native(out, inp, group, async_op),
        lambda: _all_gather_emulated(out, inp, group, async_op),
    )


def _reduce_scatter_native(out: torch.Tensor, inp: torch.Tensor, op: Op, group: Group, async_op: bool) -> Work[object]:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _handle(scatter(out, inp, op=op, group=group, async_op=async_op))


def _reduce_scatter_emulated(
    out: torch.Tensor, inp: torch.Tensor, op: Op, group: Group, async_op: bool
) -> Work[object]:
    """All-reduce a copy of the input, keep this rank's chunk: twice the native wire bytes."""
    full = inp.detach().clone()
    mine = group_rank(group)

    def finish() -> None:
        out.copy_(full.view(-1).chunk(group_size(group))[mine].view(out.shape))

    work = _handle(dist.all_reduce(full, op=op, group=group, async_op=async_op))
    if async_op:
        return Then([work], finish)
    finish()
    return work


@named_failures("reduce_scatter_tensor")
def reduce_scatter_tensor(
    out: torch.Tensor,
    inp: torch.Tensor,
    op: Op = SUM,
    group: Group = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Work[object]:
    """Reduce `inp` over the group; member i keeps chunk i (along dim 0) in `out`."""
    return _chunked(
        "reduce_scatter",
        out,
        inp,
        group,
        async_op,
        tag,
        lambda: _reduce_scatter_native(out, inp, op, group, async_op),
        lambda: _reduce_scatter_emulated(out, inp, op, group, async_op),
    )


def reduce_scatter_parts(
    t: torch.Tensor, parts: Sequence[torch.Tensor], op: Op = SUM, group: Group = None, tag: str | None = None
) -> Work[torch.Tensor]:
    """Reduce `t` over the group, asynchronously; member r keeps `parts[r]` (views of `t` that
    tile it), reduced in place: `wait()` gives it. Counted as `reduce_scatter_tensor`. The
    caller gives `t` up: what lies outside its own part is left undefined.

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
    mine = parts[group_rank(group)]
    if not dist.is_initialized():
        return Done(mine)
    return Then([_reduce_parts_into(t, parts, mine, op, group, tag=tag)], lambda: mine)


@named_failures("reduce_scatter_tensor")
def _reduce_parts_into(
    t: torch.Tensor, parts: Sequence[torch.Tensor], mine: torch.Tensor, op: Op, group: Group, tag: str | None = None
) -> Work[object]:
    """`reduce_scatter_parts`' collective, counted and started (`mine`: my part of `t`)."""
    record_chunks("reduce_scatter", tag, group, nbytes(mine))
    if dist.get_backend(group) == "gloo":
        return _handle(dist.all_reduce(t, op=op, group=group, async_op=True))
    in_order = all(p.data_ptr() == t.data_ptr() + i * mine.numel() * t.element_size() for i, p in enumerate(parts))
    src = t.view(-1) if in_order else torch.cat([p.reshape(-1) for p in parts])
    return _reduce_scatter_native(mine.view(-1), src, op, group, async_op=True)


def _all_to_all_emulated(
    out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group, async_op: bool
) -> Work[object]:
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
    works = start_p2p(ops) if ops else []
    if async_op:
        return Then(works, lambda: None)
    for w in works:
        w.wait()
    return Done(None)


@named_failures("all_to_all_single")
def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
    tag: str | None = None,
) -> Work[object]:
    """Member j receives slice j (along dim 0) of every member's `inp`, in member order."""
    if not dist.is_initialized():
        out.copy_(inp.reshape(out.shape))
        return Done(None)
    k = group_size(group)
    row = nbytes(out) // max(out.shape[0], 1) if out.dim() else out.element_size()
    if output_split_sizes is None:
        if out.shape[0] % k:
            raise ValueError(f"all_to_all_single: dim 0 of size {out.shape[0]} does not divide by {k}")
        record_chunks("all_to_all", tag, group, nbytes(out) // k)
    else:
        record_from_peers("all_to_all", tag, group, [s * row for s in output_split_sizes])
    out_splits = output_split_sizes or [out.shape[0] // k] * k
    in_splits = input_split_sizes or [inp.shape[0] // k] * k
    return _native_or_emulated(
        "all_to_all",
        lambda: _handle(
            dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        ),
        lambda: _all_to_all_emulated(out, inp, out_splits, in_splits, group, async_op),
    )


@named_failures("broadcast")
def broadcast(
    t: torch.Tensor, src: int, group: Group = None, async_op: bool = False, tag: str | None = None
) -> Work[object]:
    """`src` is a global rank, as in torch.distributed."""
    if not dist.is_initialized():
        return Done(None)
    if dist.get_rank() != src:
        ranks = group_ranks(group)
        sender = src
        if dist.get_backend(group) in wire.RING_BACKENDS:  # gloo: from my parent in its binomial tree
            sender = ranks[wire.broadcast_parent(ranks.index(dist.get_rank()), ranks.index(src), len(ranks))]
        record_from_peers("broadcast", tag, group, [nbytes(t) if p == sender else 0 for p in ranks])
    else:
        counter.record("broadcast", tag or "broadcast", 0, 0)
    return _handle(dist.broadcast(t, src=src, group=group, async_op=async_op))


@named_failures("all_gather_object")
def all_gather_object(obj: _W, group: Group = None, tag: str | None = None) -> list[_W]:
    """Every member's picklable `obj` (each of the same type), in group-rank order (counted as
    its pickled size)."""
    if not dist.is_initialized():
        return [obj]
    out: list[_W] = [obj] * group_size(group)  # every item replaced by the gather
    dist.all_gather_object(out, obj, group=group)
    sizes = [len(pickle.dumps(o)) for o in out]
    if dist.get_backend(group) in wire.RING_BACKENDS:  # torch gathers the sizes, then each object padded to the largest
        counter.record(
            "all_gather_object",
            tag or "all_gather_object",
            *wire.chunk_bytes("all_gather", shape(group), max(sizes) + 8),
        )
    else:
        record_from_peers("all_gather_object", tag, group, sizes)
    return out


@named_failures("barrier")
def barrier(group: Group = None, tag: str | None = None) -> None:
    if not dist.is_initialized():
        return
    counter.record("barrier", tag or "barrier", 0, 0)
    dist.barrier(group=group)


def write_world_report(path: str, group: Group = None) -> dict[str, object]:
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
