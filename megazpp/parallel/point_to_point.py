"""Counted point-to-point operations (send, recv, batched isend / irecv), with CUDA tensors on
gloo staged through host copies.

Why apart from `comm`: the staging is a job of its own (gloo's send / recv hand a tensor's data
pointer to the transport as host memory, with no device check: docs/arch/parallel.md), shared by
the pipeline's neighbour exchange and the all-to-all emulation in `comm`. `comm` re-exports
these functions: callers still name one counted layer. The receiver counts the bytes.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megazpp.parallel.groups import EMULATED, nbytes, record_recv
from megazpp.parallel.work import Then, Work, named_failures

P2POp = dist.P2POp


def _host_staged(t: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether a point-to-point tensor must travel through a host copy: a device tensor on gloo
    (whose send / recv would read device memory as host memory), or any tensor once a test
    forced the staged path (`"p2p"` in `groups.EMULATED`) so it stays exercised on CPU ranks."""
    if dist.get_backend(group) != "gloo":
        return False
    return t.device.type != "cpu" or "p2p" in EMULATED


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of `t` (on CUDA: after the work queued on `t`'s stream)."""
    return t.detach().to("cpu", copy=True).contiguous()


def start_p2p(ops: list[P2POp]) -> list[Work[object]]:
    """`dist.batch_isend_irecv` with device tensors on gloo staged through host copies: sends go
    from a copy made now; a receive lands in a host buffer, copied into its tensor when its
    work's `wait()` returns (`Then`), so it is complete exactly when the native one would be.
    Uncounted: the callers count."""
    staged: list[P2POp] = []
    finish: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for op in ops:
        if not _host_staged(op.tensor, op.group):
            staged.append(op)
            finish.append(None)
        elif op.op is dist.irecv:
            host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device="cpu")
            staged.append(dist.P2POp(dist.irecv, host, op.peer, op.group))
            finish.append((op.tensor, host))
        else:
            staged.append(dist.P2POp(dist.isend, _host_copy(op.tensor), op.peer, op.group))
            finish.append(None)
    works = dist.batch_isend_irecv(staged)
    return [w if pair is None else Then([w], functools.partial(_copy_into, *pair)) for w, pair in zip(works, finish)]


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


@named_failures("send")
def send(t: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: str | None = None) -> None:
    """Blocking send to global rank `dst`; the receiver does the counting."""
    dist.send(_host_copy(t) if _host_staged(t, group) else t, dst, group=group)


@named_failures("recv")
def recv(t: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: str | None = None) -> None:
    """Blocking receive from global rank `src`."""
    record_recv(tag, src, nbytes(t))
    if _host_staged(t, group):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        dist.recv(host, src, group=group)
        t.copy_(host)
    else:
        dist.recv(t, src, group=group)


def send_op(t: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> P2POp:
    return dist.P2POp(dist.isend, t, dst, group)


def recv_op(t: torch.Tensor, src: int, group: ProcessGroup | None = None) -> P2POp:
    return dist.P2POp(dist.irecv, t, src, group)


@named_failures("batch_isend_irecv")
def batch_isend_irecv(ops: list[P2POp], tag: str | None = None) -> list[Work[object]]:
    """Start all `ops` (from `send_op` / `recv_op`); returns their handles."""
    if not ops:
        return []
    for op in ops:
        if op.op is dist.irecv:
            record_recv(tag, op.peer, nbytes(op.tensor))
    return start_p2p(ops)
