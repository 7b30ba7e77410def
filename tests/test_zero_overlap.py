"""Later stages of two-stage collectives start at progress points, in the same order on every
rank (`collectives.StageOrder`). One 4-rank spawn as 2 virtual nodes x 2 ranks (k = 2, m = 2)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megazpp.launch.local_ranks import run_ranks
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.zero import sequences
from megazpp.zero.collectives import PendingSequence, zero_groups
from megazpp.zero.strategy import Level, Strategy

pytestmark = pytest.mark.multirank

TWO = sequences.Hierarchy(gather=True, reduce=True, all_reduce=True)
NUMEL = 32


def _calls() -> int:
    return comm.counter.step_totals()["ops"].get("all_gather", {}).get("calls", 0)


def _full(i: int, rank: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + 100 * i + 10 * rank


def _shard(i: int, rank: int) -> torch.Tensor:
    return _full(i, rank)[: NUMEL // 4].clone()


# the G-piece a rank owns (rank = PaRO group * k + local; piece = local * m + group)
PIECE = {0: 0, 1: 2, 2: 1, 3: 3}


def _gathered(i: int) -> list[float]:
    want = torch.empty(NUMEL)
    for r in range(4):
        want[PIECE[r] * 8 : (PIECE[r] + 1) * 8] = _shard(i, r)
    return want.tolist()


def _rank_main() -> dict:
    rank = dist.get_rank()
    groups, _ = zero_groups(Topology.from_env(ranks_per_node=2), 2, 1)
    out: dict = {}

    # 1. stage 2 is issued at a progress point once stage 1 has completed, before any wait()
    #    (a gather: gloo's reduce-scatter work never reports completion, docs/arch/zero.md)
    comm.counter.reset_step()
    gather = sequences.gather_sequence(Level.G, Level.N, 2, TWO)
    pending = PendingSequence(gather, _shard(0, rank), groups, "test")
    launched = _calls()
    while not pending.current_done():
        time.sleep(0.001)
    issued = groups.order.progress()
    out["calls"] = (launched, issued, _calls())
    out["gathered"] = pending.wait().tolist()

    # 2. progress at rank-dependent moments, waits in reverse launch order: every rank issues the
    #    later stages in the same order, so the results are the exact ones
    comm.counter.reset_step()
    seqs = [
        sequences.reduce_sequence(Level.N, Level.G, 2, TWO),
        sequences.gather_sequence(Level.G, Level.N, 2, TWO),
        sequences.boundary_sequence(Strategy(Level.N, Level.N, Level.N), 2, TWO),
    ]
    works = []
    for i in range(9):
        seq = seqs[i % 3]
        t = _shard(i, rank) if seq[0].op == "all_gather" else _full(i, rank)
        works.append(PendingSequence(seq, t, groups, "test"))
        time.sleep(0.002 * ((rank + i) % 3))
        if (rank + i) % 2:
            groups.order.progress()
    out["results"] = [w.wait().tolist() for w in reversed(works)][::-1]
    totals = comm.counter.step_totals()["ops"]
    out["stage_calls"] = sum(row["calls"] for row in totals.values())
    return out


def test_later_stages_start_at_progress_points_in_one_order() -> None:
    results = run_ranks(_rank_main, 4, timeout_s=120, env={"LOCAL_WORLD_SIZE": "2"})
    for rank, res in enumerate(results):
        assert res["calls"] == (1, 1, 2)  # stage 2 issued by progress(), before wait()
        assert res["gathered"] == _gathered(0)
        piece = PIECE[rank]
        for i, got in enumerate(res["results"]):
            total = sum(_full(i, r) for r in range(4))
            if i % 3 == 0:  # reduce-scatter N -> G: my G-piece of the sum
                assert got == total[piece * 8 : (piece + 1) * 8].tolist()
            elif i % 3 == 1:  # gather G -> N
                assert got == _gathered(i)
            else:  # all-reduce in three stages
                assert got == total.tolist()
        assert res["stage_calls"] == 3 * (2 + 2 + 3)  # every stage, each once
