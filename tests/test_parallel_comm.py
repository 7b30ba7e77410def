"""Counted collectives: results, byte formulas per link class, emulated gloo paths (and the
host-staged point-to-point path CUDA tensors take on gloo), topology groups and rejected
shapes. One 4-rank spawn as 2 virtual nodes x 2 ranks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megazpp.errors import TopologyError
from megazpp.launch.local_ranks import run_ranks
from megazpp.parallel import comm, groups
from megazpp.parallel.counter import CommCounter
from megazpp.parallel.topology import Topology, check_model_split, check_shape

ELEMS = 24  # fp32 elements of the "known size" tensors: N = 96 bytes
N = ELEMS * 4


def _collectives(tag: str) -> dict:
    """Run each collective once on the world group; return results and counted bytes."""
    rank = dist.get_rank()
    out = {}
    comm.counter.reset_step()

    inp = torch.full((ELEMS // 4,), float(rank))
    gathered = torch.empty(ELEMS)
    comm.all_gather_into_tensor(gathered, inp, tag=tag)
    out["all_gather"] = gathered.tolist()

    full = torch.arange(ELEMS, dtype=torch.float) * (rank + 1)
    shard = torch.empty(ELEMS // 4)
    comm.reduce_scatter_tensor(shard, full, tag=tag, async_op=True).wait()
    out["reduce_scatter"] = shard.tolist()

    summed = torch.arange(ELEMS, dtype=torch.float) + rank
    comm.all_reduce(summed, tag=tag, async_op=True).wait()
    out["all_reduce"] = summed.tolist()

    sent = torch.arange(ELEMS, dtype=torch.float) + 100 * rank
    got = torch.empty(ELEMS)
    comm.all_to_all_single(got, sent, tag=tag)
    out["all_to_all"] = got.tolist()

    b = torch.full((ELEMS,), float(rank))
    comm.broadcast(b, src=0, tag=tag)
    out["broadcast"] = b.tolist()

    msg = torch.full((ELEMS,), 7.0) if rank == 0 else torch.empty(ELEMS)
    if rank == 0:
        comm.batch_isend_irecv([comm.send_op(msg, 3)], tag=tag)[0].wait()
    elif rank == 3:
        work = comm.batch_isend_irecv([comm.recv_op(msg, 0)], tag=tag)[0]
        out["p2p_staged"] = isinstance(work._work, comm.Then)  # received into a host copy
        work.wait()
        out["p2p"] = msg.tolist()
    if rank == 1:
        comm.send(torch.full((ELEMS,), 5.0), dst=2, tag=tag)
    elif rank == 2:
        comm.recv(msg, src=1, tag=tag)
        out["p2p"] = msg.tolist()
    out["counts"] = comm.counter.step_totals()
    return out


def _parts_collectives() -> dict:
    """The ZeRO engine's forms: pieces named by member (here in reverse order), reductions in
    place on the caller's buffer."""
    rank = dist.get_rank()
    comm.counter.reset_step()
    out = {}
    gathered = torch.empty(ELEMS)
    comm.all_gather_into_parts(
        list(gathered.chunk(4))[::-1], torch.full((ELEMS // 4,), float(rank)), tag="parts", async_op=True
    ).wait()
    out["all_gather"] = gathered.tolist()
    full = torch.arange(ELEMS, dtype=torch.float) * (rank + 1)
    part = comm.reduce_scatter_parts(full, list(full.chunk(4))[::-1], tag="parts").wait()
    out["reduce_scatter"] = part.tolist()
    out["in_place"] = part.data_ptr() == full.data_ptr() + (3 - rank) * (ELEMS // 4) * 4
    out["counts"] = comm.counter.step_totals()
    return out


def _rank_main(report_dir: str) -> dict:
    rank = dist.get_rank()
    topo = Topology.from_env(ranks_per_node=2)
    res = {"native": _collectives("native")}
    # "p2p": point-to-point through host copies, as for CUDA tensors on gloo (ranks sharing a
    # GPU); with all_to_all emulated by isend / irecv, that goes through them too
    groups.EMULATED.update({"all_gather", "reduce_scatter", "all_to_all", "p2p"})
    res["emulated"] = _collectives("emulated")
    groups.EMULATED.clear()
    res["parts"] = _parts_collectives()
    res["topo"] = dict(
        dp=topo.dp,
        node=topo.node,
        num_nodes=topo.num_nodes,
        dp_ranks=topo.dp_ranks,
        intra=topo.dp_intra_ranks,
        inter=topo.dp_inter_ranks,
        sub2=topo.dp_subgroup(2)[0],
        sub4=topo.dp_subgroup(4)[0],
        cross2=topo.dp_cross_subgroup(2)[0],
        cross1=topo.dp_cross_subgroup(1)[0],
    )
    t22 = Topology.from_env(tp=2, pp=2, ranks_per_node=2)
    res["tp2pp2"] = dict(
        tp=t22.tp_ranks,
        pp=t22.pp_ranks,
        dp=t22.dp_ranks,
        emb=t22.embedding_ranks,
        tp_rank=t22.tp_rank,
        pp_rank=t22.pp_rank,
        layers=t22.layer_range(4),
        mp=t22.model_parallel_ranks,
    )
    t2 = Topology.from_env(tp=2, ranks_per_node=2)
    res["dp2tp2"] = dict(tp=t2.tp_ranks, dp=t2.dp_ranks, intra=t2.dp_intra_ranks, inter=t2.dp_inter_ranks)
    errors = {}
    for name, kwargs in {
        "tp3": dict(tp=3),
        "tp_across_nodes": dict(tp=4, ranks_per_node=2),
        "rpn3": dict(ranks_per_node=3),
        "pp8": dict(pp=8),
    }.items():
        try:
            Topology.from_env(**kwargs)
        except TopologyError as err:
            errors[name] = str(err)
    res["errors"] = errors
    sizes = SimpleNamespace(
        num_attention_heads=6,
        num_query_groups=2,
        vocab_size=512,
        ffn_hidden_size=64,
        num_layers=3,
        seq_length=16,
        num_experts=0,
        moe_ffn_hidden_size=None,
    )
    try:
        check_model_split(sizes, t22.tp, t22.pp)
    except TopologyError as err:
        res["model_error"] = str(err)
    if rank == 0:
        comm.counter.write_report(f"{report_dir}/comm.json")
    res["world"] = comm.write_world_report(f"{report_dir}/world.json")
    return res


def _expected_counts(rank: int) -> dict:
    """Formulas on gloo (megazpp.parallel.wire), 2 nodes x 2 ranks: the rings 0-1-2-3-0 have 4
    hops, 2 of them between nodes, and each rank counts a quarter of the ring: all-gather hops
    carry 3 chunks, all-reduce hops (a reduce-scatter is gloo's all-reduce) 2 x 3 chunks.
    all_to_all is direct (1 peer on the node, 2 on the other); the broadcast from 0 is a
    binomial tree 0->1, 0->2, 1->3."""
    intra_peers, inter_peers = 1, 2
    per_peer = N // 4
    ring = 3 * per_peer
    exp = {
        "all_gather": (ring // 2, ring // 2),
        "reduce_scatter": (ring, ring),
        "all_reduce": (ring, ring),
        "all_to_all": (intra_peers * per_peer, inter_peers * per_peer),
        "broadcast": {0: (0, 0), 1: (N, 0), 2: (0, N), 3: (0, N)}[rank],
    }
    if rank in (2, 3):
        exp["p2p"] = (0, N)
    return exp


def test_collectives_count_bytes_by_formula(tmp_path):
    results = run_ranks(_rank_main, 4, str(tmp_path), timeout_s=120)
    for rank, res in enumerate(results):
        for path in ("native", "emulated"):
            got = res[path]
            assert got["all_gather"] == [float(r) for r in range(4) for _ in range(ELEMS // 4)]
            full_sum = [float(i * 10) for i in range(ELEMS)]  # sum over ranks of i*(r+1)
            assert got["reduce_scatter"] == full_sum[rank * 6 : (rank + 1) * 6]
            assert got["all_reduce"] == [float(4 * i + 6) for i in range(ELEMS)]
            assert got["all_to_all"] == [float(100 * src + rank * 6 + j) for src in range(4) for j in range(6)]
            assert got["broadcast"] == [0.0] * ELEMS
            if rank in (2, 3):
                assert got["p2p"] == [7.0 if rank == 3 else 5.0] * ELEMS
            if rank == 3:
                assert got["p2p_staged"] == (path == "emulated")
            ops = got["counts"]["ops"]
            expected = _expected_counts(rank)
            assert {op: (row["intra"], row["inter"]) for op, row in ops.items() if op in expected} == expected
            assert got["counts"]["intra"] == sum(v[0] for v in expected.values())
            assert got["counts"]["inter"] == sum(v[1] for v in expected.values())
            assert got["counts"]["tags"][path]["calls"] == len(ops)
        parts = res["parts"]  # member r's piece in chunk 3 - r; counted as the plain operations
        assert parts["all_gather"] == [float(3 - c) for c in range(4) for _ in range(ELEMS // 4)]
        chunk = 3 - rank
        assert parts["reduce_scatter"] == full_sum[chunk * 6 : (chunk + 1) * 6] and parts["in_place"]
        expected = _expected_counts(rank)
        assert {op: (row["intra"], row["inter"]) for op, row in parts["counts"]["ops"].items()} == {
            op: expected[op] for op in ("all_gather", "reduce_scatter")
        }
    topo = [r["topo"] for r in results]
    assert [t["node"] for t in topo] == [0, 0, 1, 1]
    assert topo[0]["intra"] == [0, 1] and topo[3]["intra"] == [2, 3]
    assert topo[0]["inter"] == [0, 2] and topo[3]["inter"] == [1, 3]
    assert topo[1]["sub2"] == [0, 1] and topo[2]["sub2"] == [2, 3] and topo[2]["sub4"] == [0, 1, 2, 3]
    assert topo[1]["cross2"] == [1, 3] and topo[2]["cross2"] == [0, 2] and topo[3]["cross1"] == [0, 1, 2, 3]
    t22 = [r["tp2pp2"] for r in results]
    assert [t["tp"] for t in t22] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [t["pp"] for t in t22] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [t["emb"] for t in t22] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [t["layers"] for t in t22] == [(0, 2), (0, 2), (2, 4), (2, 4)]
    assert t22[0]["dp"] == [0] and t22[0]["mp"] == [0, 1, 2, 3]
    d2 = [r["dp2tp2"] for r in results]
    assert [t["dp"] for t in d2] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert d2[0]["intra"] == [0] and d2[0]["inter"] == [0, 2]
    errors = results[0]["errors"]
    assert "not divisible by tensor_model_parallel_size 3" in errors["tp3"]
    assert "must divide ranks_per_node 2" in errors["tp_across_nodes"]
    assert "not divisible by ranks_per_node 3" in errors["rpn3"]
    assert "pipeline_model_parallel_size 8" in errors["pp8"]
    assert results[0]["model_error"] == "model num_layers = 3 is not divisible by pipeline_model_parallel_size = 2"
    world = json.loads((tmp_path / "world.json").read_text())
    assert world == results[1]["world"]
    assert world["world"]["inter"] == sum(
        r[path]["counts"]["inter"] for r in results for path in ("native", "emulated", "parts")
    )
    report = json.loads((tmp_path / "comm.json").read_text())
    assert report["run"]["inter"] == sum(
        results[0][path]["counts"]["inter"] for path in ("native", "emulated", "parts")
    )


def test_shape_checks_without_ranks():
    assert check_shape(8, 2, 2, 4) == 2
    with pytest.raises(TopologyError, match="spreads unevenly"):
        check_shape(6, 1, 2, 2)
    with pytest.raises(TopologyError, match="positive integer"):
        check_shape(4, 0, 1, 4)
    solo = Topology.from_env()
    assert (solo.world_size, solo.tp_group, solo.dp_subgroup(1)[0]) == (1, None, [0])
    with pytest.raises(TopologyError, match="world size 1 is not divisible"):
        Topology.from_env(tp=2)


def test_counter_scalars_and_steps():
    c = CommCounter()
    c.record("all_gather", "zero/param_gather", 10, 30)
    c.record("all_reduce", "dp/grads", 5, 0)
    assert c.scalars() == {
        "comm/intra_bytes": 15,
        "comm/inter_bytes": 30,
        "comm/all_gather/intra_bytes": 10,
        "comm/all_gather/inter_bytes": 30,
        "comm/all_reduce/intra_bytes": 5,
        "comm/all_reduce/inter_bytes": 0,
    }
    assert c.end_step()["comm/inter_bytes"] == 30 and c.step_totals()["inter"] == 0
    c.record("all_gather", "zero/param_gather", 1, 2)
    assert c.step_totals()["inter"] == 2 and c.run_totals()["inter"] == 32 and c.steps == 1


class _Flag:
    """A stand-in handle that completes when told to."""

    def __init__(self) -> None:
        self.done = False

    def wait(self) -> bool:
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def test_then_completes_with_every_work_and_finishes_once():
    """`Then` over several works (the emulated all-to-all's isend / irecv) reports completion only
    once all of them have completed, so a progress point never blocks on it; its finishing step
    runs once and its result is what every `wait()` gives."""
    first, second = _Flag(), _Flag()
    steps: list[int] = []
    then = comm.Then([first, second], lambda: steps.append(1) or len(steps))
    assert isinstance(then, comm.Work) and not then.is_completed()
    first.done = True
    assert not then.is_completed()
    second.done = True
    assert then.is_completed()
    assert (then.wait(), then.wait(), steps) == (1, 1, [1])
