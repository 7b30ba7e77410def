"""The inner optimizer's state averaged across islands at a fragment's outer sync (as DES-LOC,
arXiv 2505.22549, does with AdamW's moments).

Why: each island's AdamW moments see only its own small-batch gradients between syncs, so
keeping them local (DiLoCo) accumulates that noise; averaging them now and then brings the
islands' optimizer state towards the one synchronous training would have. Every state tensor
the inner optimizer keeps (`InnerEngine.state_names`, by name, so the loop is the same over any
inner optimizer) is averaged at the k-th sync of a fragment when k is a multiple of
`outer.optimizer_state_every`, counted by the fragment's applied syncs (`DiLoCoEngine.syncs`,
outer state, the warmup's count too), so a resume keeps the schedule. One period for all of
them: DES-LOC's (the first moment every 3 syncs, the second every 6) measured no better than
keeping them per island and worse than every sync (docs/benchmarks.md).

A moment is averaged over the peer group as the pseudo-gradient is (`Exchange`: an all-to-all,
the fp32 mean of the chunks, an all-gather; the counter's tag `outer/moments`), in
`traffic.moment_wire`, for the fragment's ranges of the flat os shard, and the mean written
into every island's tensors in place, so they end bit-equal. It is blocking, at the step the
fragment is due, also under `outer.overlap_steps`: the mean replaces the islands' moments, so
there is nothing to merge when it lands and nothing of it in flight at a checkpoint; its
latency is not hidden, which the rare period (every k-th sync) keeps small.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed import ProcessGroup

from megazpp.outer import traffic
from megazpp.outer.exchange import WIRE_DTYPES, Exchange
from megazpp.outer.fragments import Fragment

log = logging.getLogger(__name__)

MOMENTS_TAG = "outer/moments"


def state_made(frag: Fragment, moments: list[dict[str, torch.Tensor]]) -> bool:
    """Whether the inner optimizer has made its state for every master of `frag` on this rank
    (`moments`: `InnerEngine.moments()`); not before its first applied step."""
    return all(moments[m] for _, _, m, _ in frag.segments)


def pack_state(frag: Fragment, moments: list[dict[str, torch.Tensor]], name: str, out: torch.Tensor) -> None:
    """Copy state `name` of `frag`'s masters into `out[:frag.numel]` (state made: `state_made`)."""
    tensors = [s.get(name, out) for s in moments]  # `out` stands in where nothing is read
    for lo, hi, view in frag.masters(tensors):
        out[lo:hi].copy_(view)


def unpack_state(frag: Fragment, moments: list[dict[str, torch.Tensor]], name: str, mean: torch.Tensor) -> None:
    """Write `mean[:frag.numel]` into state `name` of `frag`'s masters, in place."""
    tensors = [s.get(name, mean) for s in moments]
    for lo, hi, view in frag.masters(tensors):
        view.copy_(mean[lo:hi])


def average_moment(
    frag: Fragment,
    moments: list[dict[str, torch.Tensor]],
    name: str,
    islands: int,
    quantize: str,
    group: ProcessGroup | None,
    device: torch.device,
) -> None:
    """Average state `name` of `frag` over the peer group (collective) and write the mean into
    this rank's tensors (`moments`: `InnerEngine.moments()`). A rank whose optimizer has not
    made its state yet (its island's steps so far all skipped) sends zeros, AdamW's initial
    value, and keeps none: the optimizer makes its own at its first step."""
    present = state_made(frag, moments)
    wire = traffic.moment_wire(quantize)
    padded = torch.zeros(traffic.padded_numel(frag.numel, islands, wire), device=device)
    if present:
        pack_state(frag, moments, name, padded)
    elif frag.segments:
        log.warning("outer: %s is not made yet on this rank (no inner step taken): zeros sent, none kept", name)
    x = Exchange.start(-1, 0, padded, frag.numel, islands, wire, WIRE_DTYPES[wire], group, tag=MOMENTS_TAG)
    mean = x.mean(group)
    if present:
        unpack_state(frag, moments, name, mean)
