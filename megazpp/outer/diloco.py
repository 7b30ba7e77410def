"""DiLoCo over islands: a ZeRO engine inside each island, an outer Nesterov step across them.

Why a wrapper and not a ZeRO path: the inner step is exactly the synchronous engine's (any
strategy, ZeRO++, LoCo, TP/PP) over the island's DP ranks; the outer step only reads and
replaces the fp32 master shards, so it asks the engine only what `zero.inner_engine.InnerEngine`
offers: the masters and their publishing, where fragments and norms sit in them, the memory
figures. The trainer sees one `Engine`.

The parameters are cut into `outer.fragments` F fragments of whole tensors (F = 1: one), each
due every H = `outer.sync_every` inner steps at its own offset (Streaming DiLoCo's staggering),
so one step starts at most one fragment's sync. A fragment's sync, on every rank at once
(docs/arch/outer.md):
1. the pseudo-gradient of this rank's os shard of the fragment: its snapshot (the parameters at
   its last sync) minus the masters now;
2. averaged over the peer group (the rank at my place in every island, holding the same shard):
   an all-to-all of it in the wire format (`outer.quantize`), the average of each chunk in fp32,
   an all-gather of the averaged chunks (`megazpp.outer.traffic` counts exactly these). With
   `outer.overlap_steps` tau > 0 the exchange runs on while tau more inner steps are taken and
   lands tau steps after it started (at once when tau = 0);
3. when it lands, Nesterov SGD on the snapshot with the average (`outer_update`): the result is
   the fragment's new snapshot and replaces its masters (with tau > 0 merged first with the
   island's own progress since the exchange started: `merge`), which are re-published to the p
   level; AdamW's state is kept.
Every island ends a fragment's sync with the same snapshot bits, and, without overlap, the same
masters, so they stay one model at the syncs.

This module is the engine: the protocol, the schedule of exchanges, the outer state and its
formulas. What it runs lives beside it: the fragments and their schedule (`fragments.py`), the
Nesterov step and the merge (`update.py`), one fragment's exchange (`exchange.py`), the logged
norms' weights (`norm_weights.py`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from megazpp.errors import CheckpointError
from megazpp.optim.engine_protocol import StepResult
from megazpp.outer import traffic
from megazpp.outer.exchange import SYNC_TAG, WIRE_DTYPES, Exchange, Int4Wire, padded_size
from megazpp.outer.fragments import build_fragments, due_fragments, fragment_names, range_indices
from megazpp.outer.moments import MOMENTS_TAG, average_moment
from megazpp.outer.norm_weights import NormWeights
from megazpp.outer.settings import OuterOptions
from megazpp.outer.update import merge, outer_update, warmed_up
from megazpp.parallel import comm
from megazpp.parallel.counter import counter
from megazpp.parallel.topology import Topology
from megazpp.zero import memory
from megazpp.zero.inner_engine import InnerEngine
from megazpp.zero.shard_map import ShardLayout

log = logging.getLogger(__name__)

OUTER_STATE_KEY = "outer"  # the engine state dict's entry for the outer state
STATS_TAG = "outer/stats"


@runtime_checkable
class TwoLevelEngine(Protocol):
    """What the banner says of two-level training, asked of whichever engine runs it."""

    options: OuterOptions
    island: Topology  # this rank's island (`Topology.island_view`)
    islands: int

    @property
    def averaged_state(self) -> tuple[str, ...]: ...

    def expected_sync_bytes(self, fragments: list[int] | None = None) -> tuple[int, int]: ...


class DiLoCoEngine:
    """The engine protocol over `inner` (a ZeRO engine over one island's DP ranks, built on
    `island`, a `Topology.island_view`), syncing across islands every `options.sync_every`
    inner steps."""

    def __init__(self, inner: InnerEngine, options: OuterOptions, island: Topology) -> None:
        self.inner = inner
        self.options = options
        self.island = island
        self.islands = island.islands
        self.inner_steps = 0
        self._wire = WIRE_DTYPES[options.quantize]
        # the masters' device: every outer buffer lives there (a rank's os shard may be empty)
        self.device = inner.device
        self.snapshot = self._masters_flat()
        self.numel = self.snapshot.numel()
        self.momentum = torch.zeros_like(self.snapshot)
        self._shard = inner.shard_map()
        self._norms = NormWeights(self._shard)
        self.fragments = build_fragments(self._shard, options.fragments)
        self.syncs = [0] * len(self.fragments)  # outer steps applied to each fragment (its warmup)
        self.in_flight: list[Exchange] = []
        self._int4 = (
            Int4Wire(traffic.DEFAULT_BLOCK, inner.shard_layout().zeropp.cpu_kernels, options.error_feedback)
            if options.quantize == "int4"
            else None
        )
        self.errors = [self._new_errors(frag.numel) for frag in self.fragments] if self._int4 else []
        self._log_start()

    def _log_start(self) -> None:
        log.info(
            "outer: DiLoCo over %d islands of %d DP ranks, H %d, lr %g, momentum %g, %s outer gradients",
            self.islands,
            self.island.dp,
            self.options.sync_every,
            self.options.lr,
            self.options.momentum,
            self.options.quantize,
        )

    # -- what the outer step reads and writes ---------------------------------------------------
    def _masters_flat(self) -> torch.Tensor:
        masters = self.inner.masters()
        return torch.cat([t.reshape(-1) for t in masters]) if masters else torch.zeros(0, device=self.device)

    def _new_errors(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int4 error feedback of a fragment: what the wire dropped of this rank's pseudo-gradient
        (the padded fragment) and of the averaged chunk it owns (fp32, zero at the start)."""
        n = traffic.padded_numel(numel, self.islands, "int4")
        return torch.zeros(n, device=self.device), torch.zeros(n // self.islands, device=self.device)

    def fragment_names(self) -> list[list[str]]:
        """The parameter names of each fragment."""
        return fragment_names(self._shard, len(self.fragments))

    def due(self, inner_steps: int) -> list[int]:
        return due_fragments(inner_steps, self.options.sync_every, len(self.fragments))

    def moments_due(self, fragment: int) -> tuple[str, ...]:
        """The inner optimizer's state averaged at the sync of `fragment` due now: all of it when
        `outer.optimizer_state_every` divides the number of this sync, its applied syncs (outer
        state, so a resume keeps the schedule) plus one (tau < H: the fragment's previous
        exchange has landed by now); none otherwise."""
        every = self.options.optimizer_state_every
        return self.averaged_state if every and (self.syncs[fragment] + 1) % every == 0 else ()

    @property
    def averaged_state(self) -> tuple[str, ...]:
        """The inner optimizer's state tensors some syncs average (none when it keeps none or
        `outer.optimizer_state_every` is 0)."""
        return self.inner.state_names if self.options.optimizer_state_every else ()

    def average_moments(self, fragment: int, names: tuple[str, ...]) -> None:
        """Average the inner optimizer's state `names` of `fragment` across islands (collective
        over the peer group, `megazpp.outer.moments`)."""
        moments, frag, o = self.inner.moments(), self.fragments[fragment], self.options
        for name in names:
            average_moment(frag, moments, name, self.islands, o.quantize, self.island.peer_group, self.device)

    # -- the engine protocol ----------------------------------------------------------------
    def shard_layout(self) -> ShardLayout:
        """The islands' layout (`zero.inner_engine.ShardedEngine`: the banner and checkpoints ask it)."""
        return self.inner.shard_layout()

    @property
    def loss_scale(self) -> float:
        return self.inner.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.scale_loss(loss)

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def grad_for(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.inner.grad_for(param)

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        with self.inner.gathered_parameters():
            yield

    def step(self) -> StepResult:
        """The inner step, then the outer work due after it: exchanges in flight advance (their
        all-gather is issued), those landing now are applied, fragments due average the inner
        optimizer's moments due and start their exchanges (which land at once without overlap)."""
        result = self.inner.step()
        self.inner_steps += 1
        t, group = self.inner_steps, self.island.peer_group
        before = self._outer_bytes()
        advanced = any(x.stage == 1 for x in self.in_flight)  # an all-gather issued now: its bytes are logged
        for x in self.in_flight:
            x.advance(group)
        landing = [x for x in self.in_flight if x.lands == t]
        self.in_flight = [x for x in self.in_flight if x.lands != t]
        scalars = self._land(landing) if landing else {}
        del landing  # their buffers go before the next exchanges' are made
        tau = self.options.overlap_steps
        started = []
        for f in self.due(t):
            self.average_moments(f, self.moments_due(f))
            started.append(self._start(f, t + tau, group))
        if tau:
            self.in_flight += started
        elif started:
            scalars = self._land(started)
        after = self._outer_bytes()
        if not (scalars or started or advanced):
            return result
        scalars.update({f"outer/{k}": float(after[k] - before[k]) for k in after})
        return StepResult(result.grad_norm, result.skipped, result.loss_scale, {**result.scalars, **scalars})

    def _outer_bytes(self) -> dict[str, int]:
        """This step's counted outer bytes so far, as logged: every outer exchange's (intra_bytes,
        inter_bytes), and when moments are averaged their part of them (moments_inter_bytes)."""
        tags = counter.step_totals()["tags"]
        sync, moments = (tags.get(tag, {"intra": 0, "inter": 0}) for tag in (SYNC_TAG, MOMENTS_TAG))
        out = {"intra_bytes": sync["intra"] + moments["intra"], "inter_bytes": sync["inter"] + moments["inter"]}
        if self.averaged_state:
            out["moments_inter_bytes"] = moments["inter"]
        return out

    # -- the outer step -----------------------------------------------------------------------
    def _start(self, f: int, lands: int, group: Any) -> Exchange:
        """Issue fragment `f`'s exchange: its pseudo-gradient (snapshot minus masters) written
        straight into the padded send buffer, piece by piece from views (a subtraction is exact,
        so this is the whole vector's result bit for bit)."""
        frag, masters = self.fragments[f], self.inner.masters()
        padded = self.snapshot.new_zeros(padded_size(frag.numel, self.islands, self.options.quantize, self._int4))
        snapshot = frag.gather(self.snapshot)
        for lo, hi, master in frag.masters(masters):
            torch.sub(snapshot[lo:hi], master, out=padded[lo:hi])
        del snapshot
        return Exchange.start(
            f,
            lands,
            padded,
            frag.numel,
            self.islands,
            self.options.quantize,
            self._wire,
            group,
            self._int4,
            self.errors[f] if self._int4 else None,
        )

    def _land(self, exchanges: list[Exchange]) -> dict[str, float]:
        """Apply landed exchanges (collective over every rank): each fragment's Nesterov step on
        the snapshot, the masters set to it (merged with the island's own progress since the
        exchange started when it overlapped: `merge`), one re-publication; returns what to log.
        One fragment at a time, each vector the fragment's length (the arithmetic of the whole
        vector, so the same bits), its temporaries freed before the next is made."""
        sums = self.snapshot.new_zeros(2)
        masters = self.inner.masters()
        lr = momentum_factor = 0.0
        for x in exchanges:
            frag = self.fragments[x.fragment]
            lr, momentum_factor = warmed_up(
                self.options.lr, self.options.momentum, self.syncs[x.fragment], self.options.warmup_syncs
            )
            self.syncs[x.fragment] += 1
            mean = x.mean(self.island.peer_group)
            scratch = torch.empty_like(mean)
            sums += torch.stack(
                [
                    self._norms.weighted_squares(frag, mean, scratch),
                    self._norms.weighted_squares(frag, x.pseudo, scratch),
                ]
            )
            del scratch
            synced, momentum = frag.gather(self.snapshot), frag.gather(self.momentum)
            outer_update(synced, mean, momentum, lr, momentum_factor)
            frag.scatter(self.snapshot, synced)
            frag.scatter(self.momentum, momentum)
            del mean, momentum
            for lo, hi, master in frag.masters(masters):  # none where this rank holds nothing of it
                if self.options.overlap_steps:  # elementwise, so piece by piece: no copy of the fragment
                    master.copy_(merge(master, synced[lo:hi], self.options.merge_alpha))
                else:
                    master.copy_(synced[lo:hi])
            del synced
        comm.all_reduce(sums, tag=STATS_TAG)
        self.inner.publish_masters()
        mean_sq, own_sq = (float(x) / self.islands for x in sums)
        return {
            "outer/pseudo_grad_norm": math.sqrt(mean_sq),
            "outer/island_divergence": math.sqrt(max(own_sq - mean_sq, 0.0)),
            "outer/lr": lr,
            "outer/momentum": momentum_factor,
        }

    # -- accounting ---------------------------------------------------------------------------
    def expected_sync_bytes(self, fragments: list[int] | None = None) -> tuple[int, int]:
        """(intra, inter) of the exchange of `fragments` (default all; tag `outer/sync`), by
        the traffic formula."""
        each = [
            traffic.sync_bytes(frag.numel, self.islands, self.options.quantize)
            for f, frag in enumerate(self.fragments)
            if fragments is None or f in fragments
        ]
        return sum(a for a, _ in each), sum(b for _, b in each)

    def expected_moment_bytes(self, fragment: int) -> tuple[int, int]:
        """(intra, inter) of averaging one moment of `fragment` (tag `outer/moments`), by the
        traffic formula."""
        return traffic.moment_sync_bytes(self.fragments[fragment].numel, self.islands, self.options.quantize)

    def held_bytes(self) -> memory.StateBytes:
        inner = self.inner.held_bytes()
        kept = [self.snapshot, self.momentum] + [t for pair in self.errors for t in pair]
        outer = sum(t.numel() * t.element_size() for t in kept)
        return memory.StateBytes(inner.params, inner.grads, inner.optimizer + outer, inner.path_state)

    def expected_bytes(self) -> memory.StateBytes:
        inner = self.inner.expected_bytes()
        outer = self.inner.expected_shard_bytes(fp32_copies=2)  # the snapshot and the momentum
        if self._int4 is not None:  # the error buffers: each fragment padded, and one chunk of it
            outer += sum(traffic.error_buffer_bytes(frag.numel, self.islands) for frag in self.fragments)
        return memory.StateBytes(inner.params, inner.grads, inner.optimizer + outer, inner.path_state)

    def expected_exchange_bytes(self) -> int:
        """The most bytes the exchanges alive at once hold, each counted at its largest
        (`traffic.exchange_bytes`) when the newest is issued: one fragment's for tau <= 1 (those
        landing at a step are applied and freed before the step's own are made), else those
        started within the last tau steps (a bound: the older ones are past their all-to-all).
        F fragments divide it by about F."""
        tau, h = self.options.overlap_steps, self.options.sync_every
        each = [traffic.exchange_bytes(frag.numel, self.islands, self.options.quantize) for frag in self.fragments]
        return max(
            sum(each[f] for s in range(t - max(tau - 1, 0), t + 1) for f in self.due(s))
            for t in range(1, 2 * h + tau + 1)
        )

    def expected_sync_peak_bytes(self) -> int:
        """Bytes a sync adds on top of `expected_bytes` at its peak: the exchanges alive at once
        and the landing's fp32 vectors of the largest fragment, or a moment's averaging where
        that is more."""
        largest = max(frag.numel for frag in self.fragments)
        peak = self.expected_exchange_bytes() + traffic.LANDING_FP32_VECTORS * 4 * largest
        if not self.averaged_state:
            return peak
        # the moments are averaged after the step's landings, before its exchanges start (a
        # bound: those issued earlier and still in flight counted at their largest)
        moment = traffic.moment_peak_bytes(largest, self.islands, self.options.quantize)
        return max(peak, moment + (self.expected_exchange_bytes() if self.options.overlap_steps > 1 else 0))

    def close(self) -> None:
        """Collective: the exchanges still in flight finish their collectives (the job ends, so
        nothing applies them: a checkpoint saved before holds them finished), then the inner
        engine closes. No gloo work may outlive the process groups (`release_process_groups`)."""
        for x in self.in_flight:
            x.mean(self.island.peer_group)
        self.inner.close()

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self, *, frozen: bool = True) -> dict[str, Any]:
        """The inner engine's state dict plus the outer state under `OUTER_STATE_KEY`."""
        return {
            **self.inner.state_dict(frozen=frozen),
            OUTER_STATE_KEY: {
                "inner_steps": self.inner_steps,
                "syncs": list(self.syncs),
                "islands": self.islands,
                "sync_every": self.options.sync_every,  # the export note's last syncs
                "quantize": self.options.quantize,  # the load rules before any rank (checkpoint.resume_check)
                "fragments": [range_indices(frag.ranges) for frag in self.fragments],
                "snapshot": self.snapshot.clone(),
                "momentum": self.momentum.clone(),
                "in_flight": [x.state_dict(self.island.peer_group) for x in self.in_flight],
                "errors": [[t.clone() for t in pair] for pair in self.errors],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Bit for bit from this layout's own state; a synchronous state (no outer state: a
        synchronous run's checkpoint, or `outer.start_iter`'s switch, which loads through here so
        that it is a warm start bit for bit) starts the first interval at its weights, with zero
        outer momentum, the inner steps counting on from the engine's step count."""
        self.inner.load_state_dict(state)
        saved = state.get(OUTER_STATE_KEY)
        if saved is None:
            self.snapshot = self._masters_flat()
            self.momentum = torch.zeros_like(self.snapshot)
            self.inner_steps = self.inner.step_count
            self.syncs = [0] * len(self.fragments)
            log.warning(
                "outer: a synchronous state (a synchronous run's checkpoint, or outer.start_iter's "
                "switch): the first outer interval starts at its weights, with zero outer momentum"
            )
            return
        if saved["snapshot"].numel() != self.numel:
            raise CheckpointError(
                f"outer state of {saved['snapshot'].numel()} elements, this rank's shard has "
                f"{self.numel} (saved under another island layout)"
            )
        saved_fragments = saved.get("fragments", [])
        if len(saved_fragments) != len(self.fragments) or not all(
            torch.equal(a, range_indices(b.ranges)) for a, b in zip(saved_fragments, self.fragments)
        ):
            raise CheckpointError(
                f"outer state saved with {len(saved_fragments)} fragments cut otherwise than this "
                f"run's {len(self.fragments)} (outer.fragments changed?)"
            )
        # copies onto the masters' device: a checkpoint written on GPU ranks resumes on CPU ones and
        # the reverse (the files are read onto the host, `map_location="cpu"`)
        self.snapshot = saved["snapshot"].to(self.device, copy=True)
        self.momentum = saved["momentum"].to(self.device, copy=True)
        self.inner_steps = int(saved["inner_steps"])
        # saved before the outer warmup existed: at most one sync per H steps were applied
        self.syncs = [
            int(n) for n in saved.get("syncs", [self.inner_steps // self.options.sync_every] * len(self.fragments))
        ]
        self.in_flight = [Exchange.from_state(x, self.device, self._int4) for x in saved.get("in_flight", [])]
        if self._int4 is not None:
            if len(saved.get("errors", [])) != len(self.fragments):
                raise CheckpointError(
                    "outer state has no int4 error buffers for these fragments (saved with another outer.quantize?)"
                )
            self.errors = [(a.to(self.device, copy=True), b.to(self.device, copy=True)) for a, b in saved["errors"]]
