"""The inner optimizer's moments averaged across islands at a fragment's outer sync (DES-LOC,
arXiv 2505.22549: AdamW's first moment every 3 syncs, its second every 6).

Why: each island's AdamW moments see only its own small-batch gradients between syncs, so
keeping them local (DiLoCo) accumulates that noise; averaging them now and then brings the
islands' optimizer state towards the one synchronous training would have. Which state and how
often is `OuterOptions.averaged_state` (by the state's name, so the loop is the same over any
inner optimizer's `InnerEngine.moments`); the k-th sync of a fragment averages a state when k is
a multiple of its period, counted by the fragment's applied syncs (`DiLoCoEngine.syncs`, outer
state, the warmup's count too), so a resume keeps the schedule.

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

from megazpp.errors import ConfigError
from megazpp.outer import traffic
from megazpp.outer.exchange import WIRE_DTYPES, Exchange
from megazpp.outer.fragments import Fragment

log = logging.getLogger(__name__)

MOMENTS_TAG = "outer/moments"


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
    held = [moments[m] for _, _, m, _ in frag.segments]
    if any(s and name not in s for s in held):
        have = sorted(next(s for s in held if s and name not in s))
        raise ConfigError(
            f"outer.{name}_every: the inner optimizer keeps no {name!r} (its state: {', '.join(have)}): "
            f"set outer.{name}_every 0"
        )
    present = all(held)
    wire = traffic.moment_wire(quantize)
    padded = torch.zeros(traffic.padded_numel(frag.numel, islands, wire), device=device)
    tensors = [s.get(name, padded) for s in moments]  # `padded` stands in where nothing is read
    if present:
        for lo, hi, view in frag.masters(tensors):
            padded[lo:hi].copy_(view)
    elif held:
        log.warning("outer: %s is not made yet on this rank (no inner step taken): zeros sent, none kept", name)
    x = Exchange.start(-1, 0, padded, frag.numel, islands, wire, WIRE_DTYPES[wire], group, tag=MOMENTS_TAG)
    mean = x.mean(group)
    if present:
        for lo, hi, view in frag.masters(tensors):
            view.copy_(mean[lo:hi])
