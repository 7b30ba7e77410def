"""H = 1 as a correctness anchor: two-level training equals synchronous ZeRO-2 where the
mathematics says it must, and visibly does not where it says it must not.

4 gloo ranks (2 virtual nodes x 2), one spawned world, each job in its own `scoped_groups`:
synchronous ZeRO-2 over the 4 ranks against 2 islands x 2 ranks of ZeRO-2 under DiLoCo with
H = 1, outer lr 1, outer momentum 0, no gradient clipping, the same init and each rank the same
micro-batches. With SGD inside (coupled L2 weight decay, heavy-ball momentum or none) every
step of an island is linear in its half-batch gradient and its own momentum buffer, the outer
step with lr 1 and momentum 0 moves the snapshot to the islands' mean, and the mean of the
islands' buffers follows the synchronous buffer's recursion: in exact arithmetic the two runs
are the same. In fp32 they differ by rounding only (the bound is derived at `ULPS_PER_STEP`). AdamW
divides each island's moment by its own second moment, a non-linear function of the
half-batch gradient, so the same comparison differs by orders of magnitude more: the negative
control that shows this anchor can fail.
"""

from __future__ import annotations

import torch
from support import TINY_LLAMA, train_losses

from megazpp.launch.local_ranks import run_ranks, scoped_groups
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.engine_protocol import Engine
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.diloco import DiLoCoEngine
from megazpp.outer.settings import OuterOptions
from megazpp.parallel.topology import Topology
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zero_engine import ZeroEngine

STEPS, MICRO = 5, 2
EPS = torch.finfo(torch.float32).eps  # one ulp of 1.0; an fp32 x rounds by at most eps * |x| / 2
# The bound, per step, in ulps of a tensor's largest element |w| (every element's own rounding
# is at most that large). The update arithmetic: synchronous p - lr * b rounds once (at most
# half an ulp of |w|); each island rounds its own p - lr * b_i (half an ulp each, averaged),
# its pseudo-gradient s - p_i is exact (Sterbenz: the two are within a factor 2 where it
# matters; elsewhere its rounding is an ulp of the step, far below |w|), their mean rounds half
# an ulp of the step, and s - mean half an ulp of |w|: together at most 2 ulps of |w| per step.
# The reduction orders differ too: ZeRO-2 sums 4 ranks' gradients in one reduce-scatter (two
# stages across the 2 nodes), the islands 2 and the outer mean the other 2, so the averaged
# gradient differs by a few roundings of its terms, and the momentum buffer carries that
# difference on (at most 1 / (1 - 0.9) = 10 times, scaled by lr * |g|, measured below |w| here).
# 4 ulps per step leaves that term as much room as the arithmetic's own 2; the errors then
# add up over the steps (a few steps at a small lr: the weights' difference does not grow
# through the gradients faster than that). Measured: at most 4.5 ulps after 6 steps.
ULPS_PER_STEP = 4
# the losses: each sums MICRO terms rounded to half an ulp of the loss (about ln 96), and the
# weights' difference moves them by gradient x difference, below the loss's own ulp here
LOSS_ULPS = 2 * MICRO
ANCHOR = OuterOptions(algorithm="diloco", sync_every=1, lr=1.0, momentum=0.0, quantize="none", island_nodes=1)
OPTIMIZERS = {
    "sgd": OptimizerOptions(name="sgd", lr=0.5, sgd_momentum=0.9, weight_decay=0.1, clip_grad=0.0),
    "sgd/plain": OptimizerOptions(name="sgd", lr=0.5, sgd_momentum=0.0, weight_decay=0.1, clip_grad=0.0),
    "adamw": OptimizerOptions(lr=1e-2, weight_decay=0.1, clip_grad=0.0),  # the negative control
}


def _run(opt: OptimizerOptions, two_level: bool) -> dict:
    """STEPS steps of this rank's micro-batches, synchronous over the 4 ranks or as 2 islands:
    its losses and the final whole fp32 weights (ZeRO-2 keeps parameters whole on every rank;
    fp32 parameters are the masters' values)."""
    cfg = ModelConfig(**TINY_LLAMA)
    zero2 = ZeroOptions(stage=2, micro_batches_per_step=MICRO)
    topo = Topology.from_env(ranks_per_node=2)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    engine: Engine
    if two_level:
        island = topo.island_view(ANCHOR.island_nodes)
        engine = DiLoCoEngine(ZeroEngine(model, opt, PrecisionOptions(), zero2, island), ANCHOR, island)
    else:
        engine = ZeroEngine(model, opt, PrecisionOptions(), zero2, topo)
    losses = train_losses(model, engine, topo.dp_rank, range(STEPS), MICRO)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return {"losses": losses, "weights": weights}


def _anchor_rank() -> dict:
    report: dict[str, dict] = {}
    for label, opt in OPTIMIZERS.items():
        for kind, two_level in (("sync", False), ("two-level", True)):
            with scoped_groups():
                report[f"{label}/{kind}"] = _run(opt, two_level)
    return report


def _differences(sync: dict, two: dict) -> tuple[float, float]:
    """(largest loss difference in ulps of the loss, largest weight difference in ulps of its
    tensor's largest element) between a synchronous and a two-level run of one rank."""
    losses = max(abs(a - b) / (EPS * abs(a)) for a, b in zip(sync["losses"], two["losses"]))
    weights = max(
        float((w - two["weights"][n]).abs().max() / (EPS * w.abs().max())) for n, w in sync["weights"].items()
    )
    return losses, weights


def test_h1_with_sgd_inside_is_synchronous_zero2_and_adamw_is_not():
    ranks = run_ranks(_anchor_rank, 4, timeout_s=600)
    for rank, report in enumerate(ranks):
        for label in OPTIMIZERS:
            losses, weights = _differences(report[f"{label}/sync"], report[f"{label}/two-level"])
            where = (rank, label, losses, weights)
            if label.startswith("sgd"):
                assert losses <= LOSS_ULPS and weights <= ULPS_PER_STEP * STEPS, where
            else:  # AdamW normalises each island's half-batch gradient: far outside the bound
                assert losses > 100 * LOSS_ULPS and weights > 1000 * ULPS_PER_STEP * STEPS, where
