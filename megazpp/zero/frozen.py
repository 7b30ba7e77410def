"""Frozen parameters under a PaRO strategy: held at level p like the trainable ones, gathered
by the same hooks, never reduced or updated.

Why: with few trainable parameters (LoRA, a few layers) the frozen weights are most of the
memory, and the PaRO paper's point for PEFT is to shard them by the strategy's p level (ING:
parameters inside the node, gradients whole, optimizer state over everyone). Frozen weights
get their own buckets (fetch groups of the frozen units, `units.parameter_units(trainable=
False)`) with a parameter shard only: no gradient accumulator, no fp32 master, no Adam moments,
so gradient and optimizer memory follow the trainable elements alone. With p = N the bucket is
the replicated flat buffer the parameters are views of.

A frozen group is fetched before the forward of its modules and, when the backward passes
through them (a LoRA adapter after a frozen weight needs the weight for the input gradient),
again before their backward unless kept (then it stays gathered to the step), exactly like a
trainable group; having no gradients to wait for, one not kept is released at the end of the
backward.
"""

from __future__ import annotations

import torch
from torch import nn

from megazpp.zero import memory, sequences, traffic
from megazpp.zero.bucket import Bucket
from megazpp.zero.layout import BucketLayout
from megazpp.zero.strategy import Level, Strategy
from megazpp.zero.units import fetch_groups, parameter_units

FROZEN_PREFIX = "frozen/"
# an engine state without its frozen buckets (an adapters-only checkpoint: the base is reloaded)
FROZEN_SAVED_KEY = "frozen_saved"


def frozen_refusal(strategy: Strategy, qwz: bool, hpz: int, persistence_threshold: int) -> str | None:
    """Why frozen groups cannot run under `strategy` with these ZeRO++ and persistence settings,
    or None: with parameters sharded, qwZ / hpZ gathers and persistent parameters are not
    implemented for them (they would be silently left out for frozen weights). The config check
    narrows the strategy by it before any process group exists; the engine refuses it for callers
    that build it directly (`engine_buckets.frozen_groups`)."""
    if strategy.params == Level.N:
        return None
    if qwz or hpz > 1:
        return (
            f"zero strategy {strategy} with qwZ / hpZ and frozen parameters "
            f"(training.trainable, LoRA) is not implemented: turn off "
            f"zero.zero_quantized_weights and zero.zero_hpz_partition_size"
        )
    if persistence_threshold > 0:
        return (
            f"zero strategy {strategy} with zero.stage3_param_persistence_threshold "
            f"and frozen parameters (training.trainable, LoRA) is not implemented: set the "
            f"threshold to 0"
        )
    return None


def frozen_buckets(
    model: nn.Module,
    strategy: Strategy,
    d: int,
    k: int,
    dp_index: int,
    dtype: torch.dtype,
    threshold: int,
    mode: str,
    max_numel: int,
) -> list[Bucket]:
    """One parameter-only bucket per fetch group of the model's frozen parameters."""
    specs = fetch_groups(model, parameter_units(model, threshold, trainable=False), mode, max_numel)
    buckets = []
    for spec in specs:
        layout = BucketLayout.build(spec.params, d, k, dp_index)
        lo, hi = layout.shard_range(strategy.params)
        store = layout.flatten(dtype)[lo:hi].clone()
        if strategy.params == Level.N:
            layout.view_params_into(store)
        buckets.append(Bucket(FROZEN_PREFIX + spec.name, layout, spec.modules, store, store.new_zeros(0), [], []))
    return buckets


def frozen_param_bytes(strategy: Strategy, padded_numels: list[int], d: int, k: int, param_bytes: int) -> int:
    """Bytes of frozen parameters one rank holds: memory.state_bytes' parameter term alone."""
    return memory.state_bytes(strategy, padded_numels, d, k, param_bytes, 0).params


def execution_keep(
    trainable: list[Bucket], frozen: list[Bucket], model: nn.Module, max_live: int, max_reuse_distance: int
) -> dict[int, bool]:
    """Which groups stay gathered from forward to backward (`traffic.reuse_mask`), over the
    trainable and frozen groups together in the order their modules are registered."""
    position = {id(m): i for i, m in enumerate(model.modules())}
    ordered = sorted(trainable + frozen, key=lambda b: position[id(b.modules[0])])
    mask = traffic.reuse_mask([b.layout.padded for b in ordered], max_live, max_reuse_distance)
    return {id(b): kept for b, kept in zip(ordered, mask)}


FETCH_PHASES = ("fetch_forward", "fetch_forward_once", "fetch_backward")


def frozen_fetch_parts(
    strategy: Strategy,
    padded_numels: list[int],
    shapes: sequences.DPShapes,
    hier: sequences.Hierarchy,
    *,
    micro_batches: int,
    param_bytes: int,
    reused: tuple[bool, ...],
) -> list[traffic.StepPart]:
    """The fetch phases of `traffic.step_parts` on the frozen groups (none with p = N): a kept
    group's one gather per step, a forward and a backward gather per micro-batch of each other,
    counted as if the backward passed through every frozen group (one that lies before the
    first trainable parameter, such as a frozen embedding, is not gathered in backward)."""
    if strategy.params == Level.N or not padded_numels:
        return []
    parts = traffic.step_parts(
        strategy,
        padded_numels,
        shapes,
        hier,
        micro_batches=micro_batches,
        param_bytes=param_bytes,
        accum_bytes=0,
        reused=reused,
    )
    return [parts[name] for name in FETCH_PHASES]
