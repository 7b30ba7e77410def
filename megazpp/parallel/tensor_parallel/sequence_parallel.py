"""Gradient sync for replicated parameters that act on sequence-parallel activations.

Under sequence parallelism a norm's weight is replicated on every TP rank but each rank
applies it to other tokens, so each rank's gradient is only a partial sum. A tensor hook
all-reduces it over TP inside backward, before autograd accumulates it: every TP rank reaches
the same hook in the same order (the layers around it run TP collectives anyway), and
engines that consume gradients in their own accumulation hooks see the full gradient.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel.registry import param_is_tp_sharded


def sync_sequence_parallel_grads(module: nn.Module, tp_group: Any) -> None:
    """Make every replicated parameter of `module` (e.g. a norm) receive the TP-summed
    gradient. Call once per module that runs on sequence-sharded activations; a no-op at TP=1."""
    if tp_group is None or comm.group_size(tp_group) == 1:
        return
    for param in module.parameters():
        if param_is_tp_sharded(param) or not param.requires_grad:
            continue
        param.register_hook(lambda grad: _summed(grad, tp_group))


def _summed(grad: Any, group: Any) -> Any:
    total = grad.contiguous().clone()
    comm.all_reduce(total, group=group, tag="sp/replicated_grad")
    return total
