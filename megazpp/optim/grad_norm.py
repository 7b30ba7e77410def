"""Global gradient L2 norm and clipping, reusable by every parallel layout.

Under tensor/pipeline/data parallelism each rank holds only part of the gradients, so the
norm is sqrt of the SUM over ranks of each rank's local sum of squares. The caller passes the
gradients this rank is responsible for counting (each distinct gradient element counted on
exactly one rank: e.g. TP-replicated tensors only on tp_rank 0, ZeRO shards once each) and the
process groups to sum over; with no groups the norm is local.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup


def global_grad_norm(
    grads: Sequence[torch.Tensor], groups: Sequence[ProcessGroup | None] = (), device: torch.device | str = "cpu"
) -> torch.Tensor:
    """L2 norm (fp32 scalar tensor) over `grads` on all ranks of `groups`; inf/NaN propagate.

    `device` places the zero of a rank that counts no gradient (it must still join the sum).
    """
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads], 2.0)
        sq = torch.stack(norms).square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=device)
    if groups:
        from megazpp.parallel import comm

        for group in groups:
            comm.all_reduce(sq, group=group, tag="train/grad_norm")
    return sq.sqrt()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor clipping multiplies the gradients by: min(1, max_norm / norm); 1 when
    `max_norm` is 0 (clipping off). Error-feedback state scales by it too (LoCo)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_by_norm_(grads: Sequence[torch.Tensor], total_norm: float, max_norm: float) -> float:
    """Scale `grads` in place so their global norm is at most `max_norm` (0 disables);
    returns the coefficient applied (`clip_coefficient`)."""
    coef = clip_coefficient(total_norm, max_norm)
    if coef < 1.0 and grads:
        torch._foreach_mul_(list(grads), coef)
    return coef
