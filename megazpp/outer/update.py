"""The outer optimizer's arithmetic: DiLoCo's Nesterov step on the pseudo-gradient, and
Streaming DiLoCo's merge of an overlapped exchange's result with the island's own progress.

Both are plain tensor functions, so the single-process reference of the tests runs the same
arithmetic as the engine (`outer/diloco.py`)."""

from __future__ import annotations

import torch


def merge(local: torch.Tensor, synced: torch.Tensor, alpha: float) -> torch.Tensor:
    """Streaming DiLoCo's mixing when an exchange overlapped `tau` inner steps: `alpha` of the
    island's own parameters (which moved on meanwhile) and 1 - alpha of the outer step's result."""
    return local.mul(alpha).add_(synced, alpha=1 - alpha)


def warmed_up(lr: float, momentum: float, syncs_done: int, warmup_syncs: int) -> tuple[float, float]:
    """The outer lr and momentum of a fragment's sync after `syncs_done` earlier ones: over the
    first `warmup_syncs` they ramp linearly from plain averaging (lr 1, momentum 0) to the set
    values. Why: from scratch the first pseudo-gradients are large and point the same way, and a
    momentum of 0.9 sums about ten of them into one step, which overshoots; plain averaging is
    safe there, and Nesterov helps once the islands' steps are smaller and noisier."""
    if syncs_done >= warmup_syncs:
        return lr, momentum
    t = syncs_done / warmup_syncs
    return 1.0 + t * (lr - 1.0), t * momentum


def outer_update(
    snapshot: torch.Tensor, mean_pseudo_grad: torch.Tensor, momentum_buf: torch.Tensor, lr: float, momentum: float
) -> None:
    """Nesterov SGD (torch.optim.SGD's form, no dampening) on `snapshot`, in place; the outer
    momentum buffer starts at zero, so the first step's buffer is the pseudo-gradient itself."""
    momentum_buf.mul_(momentum).add_(mean_pseudo_grad)
    snapshot.sub_(mean_pseudo_grad.add(momentum_buf, alpha=momentum), alpha=lr)
