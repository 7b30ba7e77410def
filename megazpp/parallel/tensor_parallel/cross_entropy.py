"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

Gathering [tokens, vocab] logits would move the largest tensor of the model; instead each
rank reduces its shard to three per-token scalars (max, target logit, sum of exponentials)
and only those are all-reduced. The softmax is kept for the closed-form backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel.mappings import applied


def _tp(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return comm.group_size(group), comm.group_rank(group)


class _Ctx(FunctionCtx):
    """What forward keeps for backward (the attributes set on torch's context)."""

    saved_tensors: tuple[torch.Tensor, ...]
    in_dtype: torch.dtype


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _Ctx, local_logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None
    ) -> torch.Tensor:
        size, rank = _tp(group)
        logits = local_logits.float()
        logits_max = logits.max(dim=-1).values
        if size > 1:
            comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=group, tag="tp/cross_entropy")
        logits = logits - logits_max.unsqueeze(-1)

        part = logits.shape[-1]
        start = rank * part
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        if size > 1:
            both = torch.stack([target_logit, sum_exp])
            comm.all_reduce(both, group=group, tag="tp/cross_entropy")
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), outside, local_target)
        ctx.in_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx: _Ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, target: torch.Tensor, tp_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token fp32 loss for `local_logits` [..., vocab / tp] and `target` [...] (global ids)."""
    return applied(_VocabParallelCrossEntropy, local_logits, target, tp_group)
