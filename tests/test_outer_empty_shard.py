"""Two-level training where a rank's os shard of a bucket is empty, on 4 gloo ranks as 2 islands x 2.

Issue 36: every empty case must sync and land. Without quantization no bucket of the tiny model
is smaller than an island's DP size, but with qwZ each DP shard is whole quantization blocks, so
a bucket holding one small tensor (a norm's 32 weights, bucketed alone here) is padded to one
block per rank and the second rank of each island holds only padding of it: no master, no
momentum, no snapshot of that bucket. The islands run ZeRO-3 with qwZ, once with one bucket per
tensor (the empty shards) and once with the model in one bucket (every rank holds some of it).
qwZ's blocks never straddle two tensors (`zero.layout`), so both runs quantize the same weights
the same way and their losses must agree within 1e-5 (only the order of the gradient-norm
reduction differs); the islands' snapshots bit for bit equal. Against `test_outer_diloco`'s
single-process reference of the two islands (fp32 weights) the bound is 5e-2, the int4 wire's in
`test_outer_streaming`: qwZ's int8 weights (255 levels per block) err less than int4's 15.
"""

from __future__ import annotations

import pytest
import torch
from support import TINY_LLAMA, zero_keys
from test_outer_diloco import MICRO, OPT, OUTER, _reference, _steps

from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.options import PrecisionOptions
from megazpp.outer.diloco import DiLoCoEngine
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zero_engine import ZeroEngine
from megazpp.zero.zeropp import ZeroPP

STEPS = 4  # H 2: two syncs
BUCKETS = {"per_tensor": 1, "one": 1 << 20}  # reduce_bucket_size: each tensor alone, or all in one


def _held(engine: DiLoCoEngine) -> list[int]:
    """Elements of parameters (not padding) in this rank's os shard of each bucket."""
    out = []
    for b in engine.inner.buckets:
        lo, hi = b.layout.shard_range(engine.inner.strategy.optimizer_state)
        ends = [(off, off + shape.numel()) for off, shape in zip(b.layout.offsets, b.layout.shapes)]
        out.append(sum(max(0, min(hi, end) - max(lo, start)) for start, end in ends))
    return out


def _empty_shard_rank() -> dict[str, dict]:
    topo = Topology.from_env(ranks_per_node=2)
    island = topo.island_view(1)
    report = {}
    for label, bucket in BUCKETS.items():
        model = GPTModel(ModelConfig(**TINY_LLAMA), tp_group=topo.tp_group)
        opts = ZeroOptions(
            paro_strategy="GGG", micro_batches_per_step=MICRO, reduce_bucket_size=bucket, **zero_keys(ZeroPP(qwz=True))
        )
        engine = DiLoCoEngine(ZeroEngine(model, OPT, PrecisionOptions(), opts, island), OUTER, island)
        steps = _steps(model, engine, topo, range(STEPS))
        peers = comm.all_gather_object(engine.snapshot, group=island.peer_group, tag="test/peers")
        report[label] = {
            "held": _held(engine),
            "names": engine.fragment_names(),
            "losses": [s["loss"] for s in steps],
            "synced": [t + 1 for t, s in enumerate(steps) if "outer/pseudo_grad_norm" in s["scalars"]],
            "islands_equal": all(torch.equal(peers[0], p) for p in peers),
        }
        engine.close()
    return report


def test_a_rank_with_an_empty_os_shard_syncs_and_lands():
    ranks = run_ranks(_empty_shard_rank, 4, timeout_s=600)
    assert any(0 in r["per_tensor"]["held"] for r in ranks)  # the case: a rank holds nothing of a bucket
    assert all(0 not in r["one"]["held"] for r in ranks)
    reference = _reference(ranks[0]["one"]["names"], steps=STEPS)
    for rank, report in enumerate(ranks):
        empty, whole = report["per_tensor"], report["one"]
        assert empty["synced"] == whole["synced"] == [2, 4], rank
        assert empty["losses"] == pytest.approx(whole["losses"], abs=1e-5), rank
        assert empty["losses"] == pytest.approx(reference[rank], abs=5e-2), rank
        assert empty["islands_equal"] and whole["islands_equal"], rank
