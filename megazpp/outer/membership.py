"""Which islands meet at an outer sync, and their token-weighted mean over the peer group.

Why torchft and not a protocol of our own (docs/arch/elastic.md has the measurements): its
lighthouse forms a quorum per request with a minimum size, drops an island that stops
heartbeating or does not ask within the join timeout, and its `Manager` reconfigures a gloo
group joining group rank r of every island in the quorum (our peer group: rank r holds the same
shard in every island) and lets the ranks of one island agree whether an exchange succeeded
(`should_commit`). The survivors of a failure keep running; a failed exchange is redone with a
new quorum from the same pseudo-gradient, since nothing was changed yet.

Every rank of an island holds one `Membership` (group rank = its rank in the island's world);
rank 0's manager heartbeats the lighthouse. One sync is one quorum, one all-gather of each
island's (id, tokens, shard size, train dataset size and seed, positions it asks for next) and
one all-reduce of its weighted pseudo-gradient (with the inner optimizer's state behind it at the
syncs that average it), both counted under `outer/sync`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceOp
from torchft import Manager, ProcessGroupGloo

from megazpp.errors import MegazppError
from megazpp.parallel import comm, wire
from megazpp.parallel.counter import counter

log = logging.getLogger(__name__)

SYNC_TAG = "outer/sync"
STORE_TAG = "outer/membership"
# A failed exchange is redone with a new quorum; each failure comes from an island that died or
# hung in it, which the next quorum leaves out, so more attempts than this means the job is failing
# as a whole, not losing an island.
MAX_ATTEMPTS = 4


LiveState = dict[str, Any]  # what a live island sends a healing one (`ElasticDiLoCoEngine.live_state`)
# what else a sync averages, asked once the quorum is formed (after a heal): given the number of
# the sync, a flat fp32 tensor to average with the pseudo-gradient's weights, or None
Extra = Callable[[int], torch.Tensor | None]


class ElasticError(MegazppError):
    """An elastic island cannot go on: unlike the other islands, or the islands cannot meet."""


@dataclass(frozen=True)
class SyncResult:
    """One outer sync's membership: the islands averaged, each one's tokens, this island's
    weight in the mean, the attempts it took (1 without a failure), the seconds this island
    waited for its quorums (the time a dropped island cost it, with the others' lateness) and,
    when this island was behind and healed in it, the island it took the live state from; each
    island's positions asked for its next interval (`DataPlan.lay_out`)."""

    islands: tuple[int, ...]
    tokens: tuple[int, ...]
    wants: tuple[int, ...]
    weight: float
    attempts: int
    quorum_s: float
    healed_from: int | None = None
    extra: torch.Tensor | None = None  # the weighted mean of what `average`'s `extra` gave

    @property
    def outer_step(self) -> bool:
        """Whether an island of the quorum trained since the last sync: an outer sync, with its
        outer step. An exchange where none did (islands that all just started, or resumed at a
        sync) only lays out the data; it is not an outer sync (`Membership.starts`)."""
        return sum(self.tokens) > 0


def peer_shape(islands: int) -> wire.GroupShape:
    """The peer group as the counter sees it: one rank per island, every hop between islands."""
    return wire.GroupShape(islands, 0, islands - 1, islands if islands > 1 else 0, "gloo")


def island_store(host: str, rank: int, timeout: timedelta, device: torch.device) -> tuple[TCPStore | None, int]:
    """The replica group's store, hosted by the island's rank 0 on a free port of `host` (the
    address the other islands reach this island at: they form the peer groups on it), its port
    broadcast to the island's ranks (collective over the island's world). Why not torchrun's
    store: its worker-facing port is the launcher's business (under run.sh's launcher nothing
    listened at MASTER_PORT for a second client), and the peer groups' keys stay apart from it.
    The port travels on `device`, the island's ranks' (NCCL, an island's backend on GPUs, moves
    only CUDA tensors)."""
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout) if rank == 0 else None
    port = torch.tensor([store.port if store is not None else 0], dtype=torch.int64, device=device)
    comm.broadcast(port, src=0, tag=STORE_TAG)
    return store, int(port.item())


class Membership:
    """This rank's torchft manager for island `island_id`: group rank `rank` of `world_size`
    (collective over the island's world when made: the replica group's store, `island_store` at
    `store_host`, its port sent on `device`, the rank's), the lighthouse at `lighthouse` (HOST:PORT)."""

    def __init__(
        self,
        island_id: int,
        lighthouse: str,
        min_islands: int,
        rank: int,
        world_size: int,
        store_host: str,
        quorum_timeout_s: float,
        sync_timeout_s: float,
        device: torch.device,
    ) -> None:
        self.island_id = island_id
        self._store, store_port = island_store(store_host, rank, timedelta(seconds=sync_timeout_s), device)
        self.rank = rank
        self.syncs = 0  # outer syncs committed
        self.starts = 0  # exchanges committed where no island had trained (the manager's step: both)
        self._live: set[int] = set()
        timeout = timedelta(seconds=sync_timeout_s)
        self._quorum_timeout = timedelta(seconds=quorum_timeout_s)
        self._pg = ProcessGroupGloo(timeout=timeout)
        self._healed_from: int | None = None
        # every island starts from the same seeded weights (layout-independent init), so no
        # start-up copy (init_sync False); an island behind the quorum heals (`share`)
        self._manager = Manager(
            pg=self._pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_islands,
            use_async_quorum=False,
            replica_id=f"island{island_id}",
            lighthouse_addr=f"http://{lighthouse}",
            store_addr=store_host,
            store_port=store_port,
            hostname=store_host,
            rank=rank,
            world_size=world_size,
            init_sync=False,
            timeout=timeout,
            quorum_timeout=self._quorum_timeout,
            connect_timeout=timeout,
        )

    def share(self, state: Callable[[], LiveState], load: Callable[[LiveState], None]) -> None:
        """The live state this island sends a peer that is behind (`state`, called in the
        quorum, before anything of this sync changed it) and how it takes one (`load`, called
        by the sync of an island behind the quorum before its exchange): torchft's checkpoint
        transport carries it from group rank r of a live island to group rank r of the healing
        one, over HTTP, peer to peer. The manager's own step (our sync count) travels with it."""

        def take(live: LiveState) -> None:
            self._healed_from = int(live["island"])
            load(live)

        self._manager.register_state_dict_fn("outer", take, state)

    def set_syncs(self, syncs: int, starts: int = 0) -> None:
        """Resume at `syncs` committed outer syncs and `starts` start exchanges (their sum is the
        manager's step, which the quorum compares)."""
        self.syncs, self.starts = syncs, starts
        self._manager.load_state_dict({"step": syncs + starts, "batches_committed": 0})

    def average(
        self,
        pseudo: torch.Tensor,
        tokens: int,
        extra: Extra | None = None,
        *,
        dataset: int = 0,
        seed: int = 0,
        wants: int = 0,
    ) -> SyncResult:
        """Replace `pseudo` (this rank's shard of the island's pseudo-gradient, fp32) by the
        mean over the islands in the quorum, weighted by the tokens each trained since the last
        sync; every island ends with the same bits. `extra`, when given, is asked after the
        quorum (an island behind it has healed by then, so every island asks for the same sync)
        for more to average alike in the same all-reduce; its mean is the result's `extra`.
        `dataset` and `seed` (the train dataset's samples and the data order's seed, which every
        island must share) and `wants` (the positions this island asks for its next interval)
        travel in the all-gather. An
        exchange where no island trained (`SyncResult.outer_step` False) is counted in
        `starts`, not `syncs`, all-reduces nothing (`pseudo` is not averaged) and its `extra`
        is None. Collective over every rank of every
        island in the quorum; redone with a new quorum when a peer fails in it."""
        own, waited = pseudo.clone(), 0.0
        self._healed_from = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            start = time.perf_counter()
            # behind the quorum (restarted, new, or late past the join timeout): torchft fetches a
            # live peer's state and calls `share`'s load here, before the exchange
            self._manager.start_quorum(allow_heal=True, timeout=self._quorum_timeout)
            waited += time.perf_counter() - start
            if self._healed_from is not None:  # (in this attempt or a failed one before) its
                # interval was trained from a stale state: it adds nothing to the mean
                tokens = 0
                own.zero_()
            # the sync being formed, as the quorum counts it (a heal moved this island's count there)
            sync = self._manager.current_step() - self.starts + 1
            more = extra(sync) if extra is not None else None
            flat = pseudo.copy_(own) if more is None else torch.cat([own, more])  # `own` kept for a redo
            info = self._gather([self.island_id, tokens, flat.numel(), dataset, seed, wants])
            if info is not None:
                ids, counts, sizes, datasets, seeds, _ = info
                total = sum(counts)
                weight = tokens / total if total else 0.0
                # a start (no island trained) has nothing to average: its exchange is the gather
                if self._check_alike(ids, counts, sizes, datasets, seeds, tokens) and total:
                    flat.mul_(weight)
                    self._all_reduce(flat)
            if self._manager.should_commit():
                assert info is not None  # committed: the gather succeeded on every rank
                ids, counts, wanted = info[0], info[1], info[5]
                if sum(counts):
                    self.syncs = self._manager.current_step() - self.starts
                else:
                    self.starts = self._manager.current_step() - self.syncs
                self._note(
                    ids, f"outer sync {self.syncs}" if sum(counts) else f"the start after outer sync {self.syncs}"
                )
                mean = None
                if more is not None:
                    pseudo.copy_(flat[: pseudo.numel()])
                    mean = flat[pseudo.numel() :] if sum(counts) else None
                return SyncResult(
                    tuple(ids), tuple(counts), tuple(wanted), weight, attempt, waited, self._healed_from, mean
                )
            log.warning(
                "outer: island %d: outer sync %d failed (%s), redone with a new quorum",
                self.island_id,
                self.syncs + 1,
                self._manager.errored() or "an island of the quorum failed",
            )
        raise ElasticError(
            f"outer: island {self.island_id}: outer sync {self.syncs + 1} failed {MAX_ATTEMPTS} times in a row "
            f"(each failure drops the island that caused it): the islands cannot meet (see the log above)"
        )

    def _gather(self, fields: list[int]) -> list[list[int]] | None:
        """Each of `fields` (id, tokens, shard size, dataset size, seed, positions asked) of every
        island in the quorum, field by field, in the quorum's order; None when the exchange failed
        (reported to the manager, so the island votes not to commit)."""
        if self._manager.errored():  # the group could not be configured
            return None
        size = self._pg.size()
        mine = torch.tensor(fields, dtype=torch.int64)
        outs = [torch.empty_like(mine) for _ in range(size)]
        counter.record("all_gather", SYNC_TAG, *wire.chunk_bytes("all_gather", peer_shape(size), mine.numel() * 8))
        try:
            self._pg.allgather([outs], [mine], AllgatherOptions()).wait()
        except Exception as exc:  # noqa: BLE001  # any transport failure is a lost peer: torchft votes on it
            self._manager.report_error(exc)
            return None
        return torch.stack(outs).t().tolist()

    def _all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the quorum (torchft's managed all-reduce: a failure marks the manager
        errored instead of raising)."""
        n = self._pg.size()
        counter.record("all_reduce", SYNC_TAG, *wire.all_reduce_bytes(t.numel() * t.element_size(), peer_shape(n)))
        self._manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()

    def _check_alike(
        self, ids: list[int], counts: list[int], sizes: list[int], datasets: list[int], seeds: list[int], tokens: int
    ) -> bool:
        """Refuse a quorum no island can average in: two islands with one id, shards of
        different sizes (another model or layout), or train datasets of different sizes or order
        seeds (the islands' positions would name other samples). The islands that trained since
        the last sync (all, at a job's start) set what is right: the island that differs from
        them stops with ElasticError, the others report the error (they vote no, so the sync is
        redone without it: nothing of theirs is lost) and get False. Of two islands with one id,
        the one that trained (`tokens`, this island's) is the job's, the newcomer stops."""
        if len(set(ids)) != len(ids):
            doubled = sorted({i for i in ids if ids.count(i) > 1})
            error = ElasticError(
                f"outer: islands {sorted(ids)} met at outer sync {self.syncs + 1}: two islands have id "
                f"{doubled[0]} (--outer-island-id must differ per island)"
            )
            twins = [n for i, n in zip(ids, counts) if i == self.island_id]
            if len(twins) > 1 and (tokens == 0 or all(n > 0 for n in twins)):
                raise error
            self._manager.report_error(error)
            return False
        unlike = (
            (
                sizes,
                f"rank {self.rank}'s shards differ between islands (%s elements): every island must run the same "
                f"model, parallel layout and ZeRO strategy",
            ),
            (
                datasets,
                "the islands' train datasets differ (%s samples): every island must read one sample order, "
                "so give every island the same outer.train_samples (--outer-train-samples)",
            ),
            (
                seeds,
                "the islands' data order seeds differ (%s): every island must read one sample order, so give "
                "every island the same training.seed (--seed)",
            ),
        )
        for values, message in unlike:
            if len(set(values)) == 1:
                continue
            error = ElasticError("outer: " + message % ", ".join(f"island {i}: {n}" for i, n in zip(ids, values)))
            right = {v for v, n in zip(values, counts) if n > 0} or set(values)
            if right != {values[ids.index(self.island_id)]}:
                raise error
            self._manager.report_error(error)
            return False
        return True

    def _note(self, ids: list[int], where: str) -> None:
        """A log line per island that joined or was dropped since the last exchange (`where`)."""
        live = set(ids)
        for j in sorted(live - self._live):
            log.info("outer: island %d joined at %s (%d islands live)", j, where, len(live))
        for j in sorted(self._live - live):
            log.warning(
                "outer: island %d dropped at %s (absent from the quorum: no heartbeat within the "
                "lighthouse's heartbeat timeout, or no quorum request within its join timeout); %d islands live",
                j,
                where,
                len(live),
            )
        self._live = live

    def leave(self) -> None:
        """This island is done: its manager stops heartbeating, so the others drop it."""
        log.info("outer: island %d leaves after outer sync %d (run finished)", self.island_id, self.syncs)
        self._manager.shutdown(wait=False)
