"""The four autograd mappings all of tensor parallelism rests on, plus their
sequence-parallel variants.

Each mapping is a pair of conjugate collectives: what forward does, backward undoes in the
dual sense (identity <-> all-reduce, split <-> all-gather, reduce-scatter <-> all-gather).
Layers call only these, so correctness of TP reduces to correctness of these eight pairs.

Tensor-parallel mappings act on the LAST dimension (hidden / vocab shards); sequence-parallel
mappings act on `SEQUENCE_DIM`, the sequence dimension of activations laid out
[batch, sequence, hidden]. A group of None or of one rank makes every mapping the identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from megazpp.parallel import comm

SEQUENCE_DIM = 1


def _world(group: ProcessGroup | None) -> int:
    return 1 if group is None else comm.group_size(group)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    k = _world(group)
    if x.shape[dim] % k:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not divide by tensor-parallel size {k}")
    return x.chunk(k, dim=dim)[comm.group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup | None, tag: str) -> torch.Tensor:
    k = _world(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((k * front.shape[0],) + tuple(front.shape[1:]))
    comm.all_gather_into_tensor(out, front, group=group, tag=tag)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None, tag: str) -> torch.Tensor:
    k = _world(group)
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % k:
        raise ValueError(f"dimension {dim} of size {front.shape[0]} does not divide by tensor-parallel size {k}")
    out = front.new_empty((front.shape[0] // k,) + tuple(front.shape[1:]))
    comm.reduce_scatter_tensor(out, front, group=group, tag=tag)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None, tag: str) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, group=group, tag=tag)
    return x


def applied(function: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """`function.apply(*args)`, typed: torch leaves `Function.apply` unannotated (it forwards its
    arguments to `forward`), and every autograd function of tensor parallelism returns one tensor."""
    apply: Callable[..., torch.Tensor] = function.apply
    return apply(*args)


class _Ctx(FunctionCtx):
    """What a mapping keeps from forward for backward (the attributes set on torch's context)."""

    group: ProcessGroup | None
    dim: int


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: _Ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(g, ctx.group, "tp/copy_grad"), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group, "tp/reduce")

    @staticmethod
    def backward(ctx: _Ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: _Ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(g, ctx.dim, ctx.group, "tp/scatter_grad"), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group, "tp/gather")

    @staticmethod
    def backward(ctx: _Ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(g, ctx.dim, ctx.group), None, None


class _GatherReduceScatterGrad(torch.autograd.Function):
    """All-gather forward; reduce-scatter backward, because each rank's gradient of the
    gathered tensor is only its partial sum (it fed a column shard of the next layer)."""

    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group, "sp/gather")

    @staticmethod
    def backward(ctx: _Ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(g, ctx.dim, ctx.group, "sp/gather_grad"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group, "sp/reduce_scatter")

    @staticmethod
    def backward(ctx: _Ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(g, ctx.dim, ctx.group, "sp/reduce_scatter_grad"), None, None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (input replicated, consumers sharded)."""
    return x if _world(group) == 1 else applied(_Copy, x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce forward (sum of partial results); identity backward."""
    return x if _world(group) == 1 else applied(_Reduce, x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; all-gather the gradient."""
    return x if _world(group) == 1 else applied(_Scatter, x, group, -1)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """All-gather the last dimension; backward keeps this rank's slice."""
    return x if _world(group) == 1 else applied(_Gather, x, group, -1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Keep this rank's chunk of the sequence; all-gather the gradient."""
    return x if _world(group) == 1 else applied(_Scatter, x, group, SEQUENCE_DIM)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None, grad_is_partial: bool = True
) -> torch.Tensor:
    """All-gather the sequence. Backward reduce-scatters (the default: the gathered tensor
    feeds a column-parallel layer, so each rank holds a partial gradient) or, with
    `grad_is_partial=False`, just keeps this rank's chunk."""
    if _world(group) == 1:
        return x
    return applied(_GatherReduceScatterGrad if grad_is_partial else _Gather, x, group, SEQUENCE_DIM)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk; all-gather the gradient."""
    return x if _world(group) == 1 else applied(_ReduceScatter, x, group, SEQUENCE_DIM)
