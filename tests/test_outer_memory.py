"""The memory of two-level training: the outer engine holds what its formula counts, nothing more.

Issue 28's benchmark saw peak RSS per rank rise by 0.6-1.0 GiB with DiLoCo, several times the
outer state (snapshot + momentum). Part of it was permanent: each fragment kept an int64 index
tensor of its elements (twice the bytes of an fp32 vector) and the norm weights an fp32 vector
the size of the shard; the rest was whole-shard copies made by every sync. These tests fail if
a permanent buffer comes back: every byte of every tensor reachable from a `DiLoCoEngine`
(apart from its island's ZeRO engine, counted by the ZeRO tests) is the formula's, and one
fragment's exchange holds exactly `traffic.exchange_bytes`. Fragments are ranges of the flat
shard, read and written through views; the unit test checks them against the element indices
a checkpoint stores.
"""

from __future__ import annotations

import dataclasses

import torch
from support import TINY_LLAMA

from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer import traffic
from megazpp.outer.diloco import DiLoCoEngine
from megazpp.outer.fragments import fragment_of, merge_ranges, range_indices
from megazpp.outer.settings import OuterOptions
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zero_engine import ZeroEngine

STEPS, MICRO, H = 4, 2, 2
OUTER = OuterOptions(algorithm="diloco", sync_every=H, lr=0.7, momentum=0.9, quantize="none", island_nodes=1)
# (label, strategy, outer options, qgZ: aligned tensors, so padding splits fragments into several ranges)
RUNS = [
    ("GGG/bf16", "GGG", dataclasses.replace(OUTER, quantize="bf16"), False),
    ("NNG/int4/frag2", "NNG", dataclasses.replace(OUTER, quantize="int4", fragments=2), False),
    ("GGG/qgz/frag2/tau1", "GGG", dataclasses.replace(OUTER, fragments=2, overlap_steps=1), True),
]


def test_fragment_ranges_match_their_indices():
    flat = torch.arange(12, dtype=torch.float32) * 1.5
    assert merge_ranges([(0, 2), (2, 5), (7, 9)]) == [(0, 5), (7, 9)]
    # two masters cover the flat shard [0, 6) and [6, 12); the fragment skips padding at 4
    frag = fragment_of([(2, 4), (5, 6), (6, 9)], [(0, 6), (6, 12)])
    assert frag.ranges == [(2, 4), (5, 9)] and frag.numel == 6
    idx = range_indices(frag.ranges)
    assert idx.tolist() == [2, 3, 5, 6, 7, 8]
    assert torch.equal(frag.gather(flat), flat[idx])
    masters = [flat[:6].clone(), flat[6:].clone()]
    views = list(frag.masters(masters))
    assert [(lo, hi) for lo, hi, _ in views] == [
        (0, 2),
        (2, 3),
        (3, 6),
    ]  # [2, 4) and [5, 6) of the first master, [0, 3) of the second
    assert torch.equal(torch.cat([v for _, _, v in views]), flat[idx])
    views[2][2].fill_(-1.0)  # a view: writes reach the master
    assert masters[1][:3].tolist() == [-1.0] * 3
    out = torch.zeros(12)
    frag.scatter(out, flat[idx])
    assert torch.equal(out[idx], flat[idx]) and out.sum() == flat[idx].sum()
    one = fragment_of([(3, 6), (6, 8)], [(0, 12)])  # one range: gathered as a view, no copy
    view = one.gather(flat)
    assert one.ranges == [(3, 8)] and view.data_ptr() == flat[3:].data_ptr()


def _tensors(obj: object, seen: set[int]) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, dataclass fields and containers."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x, seen)]
    if dataclasses.is_dataclass(obj) or isinstance(obj, DiLoCoEngine):
        return [t for x in vars(obj).values() for t in _tensors(x, seen)]
    return []


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (a view counts its whole storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _held_rank() -> dict:
    topo = Topology.from_env(ranks_per_node=2)
    island = topo.island_view(1)
    cfg = ModelConfig(**TINY_LLAMA)
    report = {}
    for label, strategy, outer, qgz in RUNS:
        model = GPTModel(cfg, tp_group=topo.tp_group)
        opts = ZeroOptions(
            paro_strategy=strategy,
            micro_batches_per_step=MICRO,
            reduce_bucket_size=4000,
            zero_quantized_gradients=qgz,
        )
        engine = DiLoCoEngine(
            ZeroEngine(model, OptimizerOptions(lr=1e-2), PrecisionOptions(), opts, island), outer, island
        )
        steps = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + topo.dp_rank)
            for _ in range(MICRO):
                ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
                engine.scale_loss(model(ids[:, :-1], ids[:, 1:]).mean() / MICRO).backward()
            engine.step()
            inner = engine.inner.held_bytes().optimizer
            seen = {id(engine.inner), id(engine.options), id(engine.island), id(engine._int4)}
            state = _tensors({k: v for k, v in vars(engine).items() if k != "in_flight"}, seen)
            steps.append(
                {
                    "state": _storage_bytes(state),
                    "held": engine.held_bytes().optimizer - inner,
                    "expected": engine.expected_bytes().optimizer - engine.inner.expected_bytes().optimizer,
                    "dtypes": sorted({str(t.dtype) for t in state}),
                    "in_flight": [_storage_bytes(_tensors(x, set())) for x in engine.in_flight],
                }
            )
        exchanges = []
        for f, frag in enumerate(engine.fragments):  # one more exchange of each, counted while its all-to-all runs
            x = engine._start(f, STEPS, island.peer_group)
            exchanges.append(
                (
                    _storage_bytes([x.pseudo, x.sent, x.received, x.full]),
                    traffic.exchange_bytes(frag.numel, engine.islands, outer.quantize),
                )
            )
            x.mean(island.peer_group)
        peers = comm.all_gather_object(engine.snapshot, group=island.peer_group, tag="test/peers")
        engine.close()
        report[label] = {
            "steps": steps,
            "exchanges": exchanges,
            "ranges": [len(f.ranges) for f in engine.fragments],
            "expected_exchange": engine.expected_exchange_bytes(),
            "islands_equal": all(torch.equal(peers[0], p) for p in peers),
        }
    return report


def test_engine_holds_exactly_the_formula(tmp_path):
    ranks = run_ranks(_held_rank, 4, timeout_s=600)
    for label, *_ in RUNS:
        for rank, report in enumerate(ranks):
            run, where = report[label], (rank, label)
            for s in run["steps"]:
                assert s["state"] == s["held"] == s["expected"], where  # no tensor the formula does not count
                assert s["dtypes"] == ["torch.float32"], where  # no int64 index tensor
                assert len(s["in_flight"]) <= 1, where
            assert all(held == formula for held, formula in run["exchanges"]), where
            # overlap 1: an exchange started at a step is in flight until the next, its all-to-all still running
            assert [bool(s["in_flight"]) for s in run["steps"]] == [label.endswith("tau1")] * STEPS, where
            assert all(
                b in [formula for _, formula in run["exchanges"]] for s in run["steps"] for b in s["in_flight"]
            ), where
            assert run["expected_exchange"] == max(formula for _, formula in run["exchanges"]), where
            assert run["islands_equal"], where
    # qgZ aligns every tensor: padding splits a fragment into several ranges (gathered, scattered)
    assert max(n for report in ranks for n in report["GGG/qgz/frag2/tau1"]["ranges"]) > 1
