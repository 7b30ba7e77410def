"""`outer.moments.average_moment` on one rank (without a process group the peer group is this
rank alone, `comm`'s world of one): the mean of one island is its own moment as the wire carries
it, written into the fragment's elements only; a rank whose optimizer made no state yet keeps
none; a state the optimizer does not keep is refused naming the key. The islands' mean over
real peers is tested in tests/test_outer_diloco.py."""

from __future__ import annotations

import pytest
import torch

from megazpp.outer.fragments import fragment_of
from megazpp.outer.moments import average_moment

# two masters of 6 elements; the fragment is [2, 10) of the flat shard: the tail of the first
# and the head of the second
FRAG = fragment_of([(2, 10)], [(0, 6), (6, 12)])
DEVICE = torch.device("cpu")


def _moments() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"exp_avg": torch.randn(6, generator=g), "exp_avg_sq": torch.rand(6, generator=g) * 1e-6 + 1e-3}
        for _ in range(2)
    ]


@pytest.mark.parametrize("quantize, wire", [("none", torch.float32), ("int4", torch.bfloat16)])
def test_one_island_writes_its_moment_as_the_wire_carries_it(quantize, wire):
    moments = _moments()
    before = [{k: t.clone() for k, t in m.items()} for m in moments]
    average_moment(FRAG, moments, "exp_avg_sq", 1, quantize, None, DEVICE)
    flat = torch.cat([m["exp_avg_sq"] for m in moments])
    was = torch.cat([m["exp_avg_sq"] for m in before])
    assert torch.equal(flat[2:10], was[2:10].to(wire).float())  # under int4 outer gradients: bf16, not int4
    assert torch.equal(flat[:2], was[:2]) and torch.equal(flat[10:], was[10:])  # outside the fragment: kept
    assert bool((flat > 0).all())
    assert all(torch.equal(m["exp_avg"], b["exp_avg"]) for m, b in zip(moments, before))  # the other state: kept


def test_a_rank_without_state_yet_keeps_none():
    moments: list[dict[str, torch.Tensor]] = [{}, {}]
    average_moment(FRAG, moments, "exp_avg", 1, "none", None, DEVICE)
    assert moments == [{}, {}]
