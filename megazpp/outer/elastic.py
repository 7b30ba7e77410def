"""DiLoCo between islands that are jobs of their own and may come and go (`outer.elastic`).

Why a subclass of `DiLoCoEngine` and not a branch in it: the state (snapshot, momentum, the
inner step count), its checkpoints and the memory figures are the same, and the synchronous
two-level path stays exactly as it was; what differs is the sync. Here the engine's world is
one island (its own torchrun job), and every H inner steps the island asks `Membership` which
islands meet, averages its pseudo-gradient with theirs weighted by the tokens each trained
since the last sync, and takes the outer Nesterov step (docs/arch/elastic.md); at the syncs
`outer.optimizer_state_every` names, the inner optimizer's state is averaged with the same
weights in the same all-reduce. The whole shard syncs at once in fp32 (streaming and compressed
wires are refused with `elastic`). Each exchange also lays out which positions of the job's
global sample order each island reads next (`DataPlan`); an island that starts at an interval's
boundary (new, or resumed at a sync) meets the others before its first inner step, so it reads
samples no other island reads.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from megazpp.errors import CheckpointError
from megazpp.optim.engine_protocol import StepResult
from megazpp.outer.data_plan import DataPlan, ranges_text
from megazpp.outer.diloco import OUTER_STATE_KEY, STATS_TAG, DiLoCoEngine
from megazpp.outer.membership import ElasticError, LiveState, Membership, SyncResult
from megazpp.outer.moments import pack_state, state_made, unpack_state
from megazpp.outer.settings import OuterOptions
from megazpp.outer.update import outer_update
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.pause import pause_point
from megazpp.zero.inner_engine import InnerEngine

log = logging.getLogger(__name__)

ELASTIC_STATE_KEY = "elastic"  # inside the outer state: the sync counts, the data plan, this island's place in it


class ElasticDiLoCoEngine(DiLoCoEngine):
    """`DiLoCoEngine` over `inner` (a ZeRO engine over this island's whole world, `island`),
    syncing with the other live islands through `membership`; `tokens_per_step`: the tokens
    one applied inner step of this island trains (its global batch, `batch_samples`, times the
    sequence length); `dataset_samples` and `data_seed`: the train dataset's size and the seed
    of the global sample order that runs through it, which every island must share."""

    def __init__(
        self,
        inner: InnerEngine,
        options: OuterOptions,
        island: Topology,
        membership: Membership,
        tokens_per_step: int,
        batch_samples: int,
        dataset_samples: int,
        data_seed: int,
    ) -> None:
        self.membership = membership
        self.tokens_per_step = tokens_per_step
        self.batch_samples, self.dataset_samples, self.data_seed = batch_samples, dataset_samples, data_seed
        self.trained_steps = 0  # inner steps applied (not skipped) since the last sync
        self.plan = DataPlan()
        self.read = 0  # positions of this island's claim read so far
        self._started = False  # whether the first batch was asked for (the start exchange is due then)
        super().__init__(inner, options, island)
        membership.share(self.live_state, self.heal)
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
        pause_point("elastic_sync")
        return StepResult(result.grad_norm, result.skipped, result.loss_scale, {**result.scalars, **self._sync()})

    def next_batch(self, size: int) -> list[int]:
        """The positions of the job's global sample order this island's next global batch of
        `size` samples reads (the trainer's `SamplePositions`): the next ones of its claim. The
        first call of an island at an interval's boundary (new, or resumed at a sync) meets the
        other islands first (collective over the live islands), which lays out its claim; an
        island resumed inside an interval reads on in the claim its checkpoint holds."""
        if not self._started:
            self._started = True
            if self.inner_steps % self.options.sync_every == 0:
                pause_point("elastic_join")
                self._sync()
        island = self.options.island_id
        positions = self.plan.positions(island, self.read, size)
        if positions is None:
            raise ElasticError(
                f"outer: island {island} has read {self.read} positions of its claim "
                f"{ranges_text(self.plan.claims.get(island, []))}, which holds fewer than {size} more: its "
                f"interval outgrew what it asked for (outer.sync_every x its global batch)"
            )
        self.read += size
        return positions

    def _sync(self) -> dict[str, float]:
        """Pseudo-gradient, its token-weighted mean over the live islands, the Nesterov step on
        the snapshot, which replaces the masters, and the next interval's data layout; returns
        what to log. An island behind the quorum heals inside `average` (`heal`), so the outer
        state is read after it. An exchange where no island trained takes no outer step."""
        frag, masters = self.fragments[0], self.inner.masters()
        snapshot = frag.gather(self.snapshot)
        pseudo = snapshot.new_zeros(frag.numel)
        for lo, hi, master in frag.masters(masters):
            torch.sub(snapshot[lo:hi], master, out=pseudo[lo:hi])
        tokens, trained = self.trained_steps * self.tokens_per_step, self.trained_steps
        wants = self.options.sync_every * self.batch_samples
        met = self.membership.average(
            pseudo, tokens, self._state_due, dataset=self.dataset_samples, seed=self.data_seed, wants=wants
        )
        self.trained_steps = 0
        self._lay_out(met)
        if not met.outer_step:
            return self._layout_only(met)
        if met.extra is not None:
            self._write_state(met.extra)
        scratch = torch.empty_like(pseudo)
        sums = self._norms.weighted_squares(frag, pseudo, scratch).reshape(1)
        del scratch
        masters = self.inner.masters()  # a heal loaded the peer's inner state
        snapshot, momentum = frag.gather(self.snapshot), frag.gather(self.momentum)
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
        if met.healed_from is not None:
            log.info(
                "outer: island %d rejoined at outer sync %d with island %d's live state%s",
                self.options.island_id,
                self.membership.syncs,
                met.healed_from,
                f" (its {trained} inner steps before it were trained from a stale state and not merged)"
                if trained
                else "",
            )
        return {
            "outer/islands_live": float(len(met.islands)),
            "outer/tokens_weight": met.weight,
            "outer/pseudo_grad_norm": math.sqrt(float(sums[0])),
        }

    def _lay_out(self, met: SyncResult) -> None:
        """The next interval's claims (the same plan on every island of the quorum), logged."""
        where = (
            f"outer sync {self.membership.syncs}"
            if met.outer_step
            else f"the start after outer sync {self.membership.syncs}"
        )
        for line in self.plan.lay_out(met.islands, met.tokens, met.wants, where):
            log.info("%s", line)
        self.read = 0

    def _layout_only(self, met: SyncResult) -> dict[str, float]:
        """An exchange where no island trained (they all start, or resumed at a sync): no outer
        step (one of the momentum alone would be one an uninterrupted run never took), only
        the data layout; a healed island's masters are set to the snapshot it took."""
        if met.healed_from is not None:
            frag = self.fragments[0]
            snapshot = frag.gather(self.snapshot)
            for lo, hi, master in frag.masters(self.inner.masters()):
                master.copy_(snapshot[lo:hi])
            self.inner.publish_masters()
        log.info(
            "outer: island %d starts with islands %s after outer sync %d (none of them trained since: no outer step)%s",
            self.options.island_id,
            ",".join(map(str, met.islands)),
            self.membership.syncs,
            f", with island {met.healed_from}'s live state" if met.healed_from is not None else "",
        )
        return {"outer/islands_live": float(len(met.islands))}

    def _state_due(self, sync: int) -> torch.Tensor | None:
        """The inner optimizer's state of this rank's shard, flat (its `averaged_state` names one
        after another), when outer sync number `sync` averages it; else None. Asked after the
        quorum, so a healed island packs the live peer's state it took. A rank whose optimizer
        made no state yet (no applied step) sends zeros, as the synchronous path does."""
        every, frag = self.options.optimizer_state_every, self.fragments[0]
        if not self.averaged_state or sync % every:
            return None
        moments, n = self.inner.moments(), frag.numel
        flat = torch.zeros(len(self.averaged_state) * n, device=self.device)
        if state_made(frag, moments):
            for i, name in enumerate(self.averaged_state):
                pack_state(frag, moments, name, flat[i * n : (i + 1) * n])
        return flat

    def _write_state(self, mean: torch.Tensor) -> None:
        """Write the islands' mean of the inner optimizer's state (`_state_due`'s layout) into it."""
        moments, frag = self.inner.moments(), self.fragments[0]
        if not state_made(frag, moments):
            log.warning("outer: the inner optimizer's state is not made yet on this rank (no step taken): none kept")
            return
        n = frag.numel
        for i, name in enumerate(self.averaged_state):
            unpack_state(frag, moments, name, mean[i * n : (i + 1) * n])

    def close(self) -> None:
        """The island leaves the membership (the others drop it), then the inner engine closes."""
        self.membership.leave()
        super().close()

    def live_state(self) -> LiveState:
        """What a healing island takes from this one (`Membership.share`), read in the quorum of
        a sync before this island changed anything in it: the outer state as the last committed
        sync left it (snapshot = the islands' common parameters, outer momentum), the sync
        count, and this rank's inner engine state, for its AdamW moments and step count (the
        healing island's own are stale or none; zero moments at a late step would make Adam's
        first updates near sign(g) x lr, too large). Views, not copies: torchft serves them
        until this island's vote, which its exchange with the healing island precedes."""
        return {
            "island": self.options.island_id,
            "syncs": self.membership.syncs,
            "starts": self.membership.starts,
            "plan": self.plan.state(),
            "inner": self.inner.state_dict(),
            "snapshot": self.snapshot,
            "momentum": self.momentum,
        }

    def heal(self, live: LiveState) -> None:
        """Take a live peer's state (`live_state`): the same layout (its shards were checked
        alike by the inner engine's load), this island's own inner step count kept (it only
        phases the syncs, and each island's iteration is its own job's). The masters are the
        peer's until this sync's outer step sets every island's to the new snapshot."""
        inner_steps, source = self.inner_steps, int(live["island"])
        unlike = (
            f"outer: island {self.options.island_id} cannot take island {source}'s live state (%s): every island "
            f"must run the same model, parallel layout and ZeRO strategy"
        )
        if live["snapshot"].numel() != self.numel:
            raise ElasticError(unlike % f"its shard has {live['snapshot'].numel()} elements, this rank's {self.numel}")
        try:
            self.inner.load_state_dict(live["inner"])
        except CheckpointError as exc:  # the inner engine's layout checks, in a heal's words
            raise ElasticError(unlike % exc) from None
        self.snapshot = live["snapshot"].to(self.device, copy=True)
        self.momentum = live["momentum"].to(self.device, copy=True)
        self.inner_steps = inner_steps
        self.membership.syncs, self.membership.starts = int(live["syncs"]), int(live["starts"])
        self.plan = DataPlan.from_state(live["plan"])
        log.info(
            "outer: island %d is behind the quorum (restarted, new, or late): took island %d's live state "
            "(as outer sync %d left it)",
            self.options.island_id,
            source,
            self.membership.syncs,
        )

    def state_dict(self, *, frozen: bool = True) -> dict[str, Any]:
        state = super().state_dict(frozen=frozen)
        state[OUTER_STATE_KEY][ELASTIC_STATE_KEY] = {
            "trained_steps": self.trained_steps,
            "syncs": self.membership.syncs,
            "starts": self.membership.starts,
            "plan": self.plan.state(),
            "read": self.read,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The outer state, the membership's counts (the quorum compares them: a resumed island
        behind the others heals at its first exchange), the data plan and this island's place
        in its claim (a resumed island inside an interval reads on there; one resumed from
        another two-level run's checkpoint has none, which its start exchange lays out when it
        resumes at a sync)."""
        super().load_state_dict(state)
        saved = state.get(OUTER_STATE_KEY, {}).get(ELASTIC_STATE_KEY)
        if saved is None:  # another two-level run's checkpoint: counted from its steps, no claim yet
            self.trained_steps = self.inner_steps % self.options.sync_every
            self.membership.set_syncs(self.inner_steps // self.options.sync_every)
            return
        self.trained_steps = int(saved["trained_steps"])
        self.membership.set_syncs(int(saved["syncs"]), int(saved["starts"]))
        self.plan = DataPlan.from_state(saved["plan"])
        self.read = int(saved["read"])
