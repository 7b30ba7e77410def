"""Keep GPT-2's tied embedding in sync when the embedding (first stage) and the output layer
(last stage) live on different pipeline stages.

Both stages hold a copy of the same matrix, initialised equal (by name). The true gradient of
the shared weight is the sum of both copies' gradients, so each step both copies receive that
sum (one all-reduce over the (first, last) pair) and, with identical optimizer updates, stay
equal. The copy on the last stage is a duplicate for gradient-norm purposes.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from megazpp.parallel import comm
from megazpp.parallel.pipeline.engine_protocol import PipelineEngine
from megazpp.parallel.tensor_parallel import param_is_tp_sharded
from megazpp.parallel.topology import Topology


def _stage_copy(model: nn.Module) -> nn.Parameter | None:
    getter = getattr(model, "tied_embedding_weight", None)
    return getter() if getter is not None else None


def tied_duplicate(model: nn.Module, topo: Topology) -> nn.Parameter | None:
    """The parameter on this rank that duplicates the first stage's tied embedding, or None."""
    if topo.pp == 1 or topo.is_first_stage:
        return None
    return _stage_copy(model)


def sync_tied_embedding_grads(model: nn.Module, topo: Topology, engine: PipelineEngine) -> None:
    """All-reduce the tied weight's gradient between the first and last stage (pp > 1)."""
    if topo.pp == 1 or not (topo.is_first_stage or topo.is_last_stage):
        return
    weight = _stage_copy(model)
    if weight is None or not weight.requires_grad:  # frozen (training.trainable): nothing to sync
        return
    grad = engine.grad_for(weight)
    if grad is None:
        raise RuntimeError(
            f"tied embedding on pipeline stage {topo.pp_rank} has no gradient to synchronise: "
            f"{type(engine).__name__}.grad_for returned None (no backward reached the tied weight "
            f"this step)"
        )
    comm.all_reduce(grad, group=topo.embedding_group, tag="pp/tied_embedding_grad")


def counts_in_norm(model: nn.Module, topo: Topology) -> Callable[[str, nn.Parameter], bool]:
    """Predicate for the engine's gradient norm: count each distinct gradient element once
    across TP and PP (TP-replicated tensors on tp_rank 0 only, the tied copy on the first stage
    only). Pair with `topo.model_parallel_group` as the norm's reduction group."""
    duplicate = tied_duplicate(model, topo)

    def rule(name: str, param: nn.Parameter) -> bool:
        if duplicate is not None and param is duplicate:
            return False
        return param_is_tp_sharded(param) or topo.tp_rank == 0

    return rule
