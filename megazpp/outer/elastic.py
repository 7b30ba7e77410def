"""DiLoCo between islands that are jobs of their own and may come and go (`outer.elastic`).

Why a subclass of `DiLoCoEngine` and not a branch in it: the state (snapshot, momentum, the
inner step count), its checkpoints and the memory figures are the same, and the synchronous
two-level path stays exactly as it was; what differs is the sync. Here the engine's world is
one island (its own torchrun job), and every H inner steps the island asks `Membership` which
islands meet, averages its pseudo-gradient with theirs weighted by the tokens each trained
since the last sync, and takes the outer Nesterov step (docs/arch/elastic.md). The whole shard
syncs at once in fp32 (streaming and compressed wires are refused with `elastic`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from megazpp.optim.engine_protocol import StepResult
from megazpp.outer.diloco import OUTER_STATE_KEY, STATS_TAG, DiLoCoEngine
from megazpp.outer.membership import Membership
from megazpp.outer.settings import OuterOptions
from megazpp.outer.update import outer_update
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.pause import pause_point
from megazpp.zero.inner_engine import InnerEngine

log = logging.getLogger(__name__)

ELASTIC_STATE_KEY = "elastic"  # inside the outer state: the tokens trained since the last sync


class ElasticDiLoCoEngine(DiLoCoEngine):
    """`DiLoCoEngine` over `inner` (a ZeRO engine over this island's whole world, `island`),
    syncing with the other live islands through `membership`; `tokens_per_step`: the tokens
    one applied inner step of this island trains (its global batch times the sequence length)."""

    def __init__(
        self,
        inner: InnerEngine,
        options: OuterOptions,
        island: Topology,
        membership: Membership,
        tokens_per_step: int,
    ) -> None:
        self.membership = membership
        self.tokens_per_step = tokens_per_step
        self.trained_steps = 0  # inner steps applied (not skipped) since the last sync
        super().__init__(inner, options, island)
        pause_point("elastic_start")

    def _log_start(self) -> None:
        log.info(
            "outer: elastic DiLoCo, island %d of %d DP ranks, H %d, lr %g, momentum %g, at least %d islands per sync",
            self.options.island_id,
            self.island.dp,
            self.options.sync_every,
            self.options.lr,
            self.options.momentum,
            self.options.min_islands,
        )

    def step(self) -> StepResult:
        """The inner step; every H-th, the outer sync with the islands live then."""
        result = self.inner.step()
        self.inner_steps += 1
        self.trained_steps += 0 if result.skipped else 1
        if self.inner_steps % self.options.sync_every:
            return result
        return StepResult(result.grad_norm, result.skipped, result.loss_scale, {**result.scalars, **self._sync()})

    def _sync(self) -> dict[str, float]:
        """Pseudo-gradient, its token-weighted mean over the live islands, the Nesterov step on
        the snapshot, which replaces the masters; returns what to log."""
        frag, masters = self.fragments[0], self.inner.masters()
        snapshot = frag.gather(self.snapshot)
        pseudo = snapshot.new_zeros(frag.numel)
        for lo, hi, master in frag.masters(masters):
            torch.sub(snapshot[lo:hi], master, out=pseudo[lo:hi])
        tokens = self.trained_steps * self.tokens_per_step
        met = self.membership.average(pseudo, tokens)
        self.trained_steps = 0
        scratch = torch.empty_like(pseudo)
        sums = self._norms.weighted_squares(frag, pseudo, scratch).reshape(1)
        del scratch
        momentum = frag.gather(self.momentum)
        outer_update(snapshot, pseudo, momentum, self.options.lr, self.options.momentum)
        frag.scatter(self.snapshot, snapshot)
        frag.scatter(self.momentum, momentum)
        for lo, hi, master in frag.masters(masters):
            master.copy_(snapshot[lo:hi])
        comm.all_reduce(sums, tag=STATS_TAG)  # over this island's ranks: the mean's whole norm
        self.inner.publish_masters()
        log.info(
            "outer: island %d, outer sync %d at step %d: islands %s, tokens %s, weight %.4g, quorum in %.2f s%s",
            self.options.island_id,
            self.membership.syncs,
            self.inner_steps,
            ",".join(map(str, met.islands)),
            ",".join(map(str, met.tokens)),
            met.weight,
            met.quorum_s,
            f", after {met.attempts} attempts" if met.attempts > 1 else "",
        )
        return {
            "outer/islands_live": float(len(met.islands)),
            "outer/tokens_weight": met.weight,
            "outer/pseudo_grad_norm": math.sqrt(float(sums[0])),
        }

    def close(self) -> None:
        """The island leaves the membership (the others drop it), then the inner engine closes."""
        self.membership.leave()
        super().close()

    def state_dict(self, *, frozen: bool = True) -> dict[str, Any]:
        state = super().state_dict(frozen=frozen)
        state[OUTER_STATE_KEY][ELASTIC_STATE_KEY] = {"trained_steps": self.trained_steps}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The outer state, and the membership's count of syncs (the quorum compares it)."""
        super().load_state_dict(state)
        saved = state.get(OUTER_STATE_KEY, {}).get(ELASTIC_STATE_KEY)
        self.trained_steps = int(saved["trained_steps"]) if saved else self.inner_steps % self.options.sync_every
        self.membership.set_syncs(self.inner_steps // self.options.sync_every)
