"""The link model the counter records and the traffic formulas price (megazpp.parallel.wire):
gloo's rings counted by the hops that cross nodes, the volume model on other backends."""

from __future__ import annotations

import pytest

from megazpp.parallel.wire import GroupShape, all_reduce_bytes, broadcast_parent, chunk_bytes


def test_ring_crossings_follow_group_order_and_nodes():
    assert GroupShape.of([0, 1, 2, 3], 0, 2, "gloo").crossings == 2  # 1->2 and 3->0
    assert GroupShape.of([0, 2], 0, 2, "gloo").crossings == 2  # both directions of the one pair
    assert GroupShape.of([0, 1], 1, 2, "gloo").crossings == 0
    assert GroupShape.of([0, 2, 4, 6], 4, 2).crossings == 4  # one member per node: every hop
    assert GroupShape.of(list(range(8)), 3, 2).crossings == 4  # 4 nodes of 2: one hop out of each
    assert GroupShape.of([5], 5, 2).crossings == 0


@pytest.mark.parametrize("ranks,rpn", [([0, 1, 2, 3], 2), (list(range(8)), 2), (list(range(8)), 4), ([0, 2, 4, 6], 2)])
def test_gloo_members_shares_add_up_to_the_rings_hops(ranks, rpn):
    """Summed over the members, each op's count is the ring's hops: k hops of (k-1) chunks
    (all-gather) or 2 (k-1) chunks (all-reduce, and gloo's reduce-scatter), each filed by
    whether it joins two nodes."""
    k, chunk = len(ranks), 40
    shapes = [GroupShape.of(ranks, me, rpn, "gloo") for me in ranks]
    crossings = shapes[0].crossings
    assert all(s.crossings == crossings for s in shapes)  # the same on every member
    for op, per_hop in (("all_gather", (k - 1) * chunk), ("reduce_scatter", 2 * (k - 1) * chunk)):
        counts = [chunk_bytes(op, s, chunk) for s in shapes]
        assert sum(c[1] for c in counts) == crossings * per_hop, op
        assert sum(c[0] for c in counts) == (k - crossings) * per_hop, op
    reduced = [all_reduce_bytes(k * chunk, s) for s in shapes]
    assert sum(c[1] for c in reduced) == crossings * 2 * (k - 1) * chunk
    assert [chunk_bytes("all_to_all", s, chunk) for s in shapes] == [
        chunk_bytes("all_to_all", GroupShape.of(ranks, me, rpn, "nccl"), chunk) for me in ranks
    ]  # direct


def test_other_backends_count_the_volume_model():
    g = GroupShape.of([0, 1, 2, 3], 0, 2, "nccl")  # 1 peer on my node, 2 on the other
    assert chunk_bytes("all_gather", g, 10) == (10, 20)
    assert chunk_bytes("reduce_scatter", g, 10) == (10, 20)
    assert all_reduce_bytes(40, g) == (20, 40)
    assert chunk_bytes("all_gather", GroupShape(1, 0, 0), 10) == (0, 0)


def test_two_members_on_two_nodes_agree_under_both_models_except_reduce_scatter():
    """A pair's ring is a direct exchange: gather and all-reduce counts do not depend on the
    backend, a reduce-scatter does (gloo all-reduces the whole buffer: twice the bytes)."""
    gloo, nccl = GroupShape.of([0, 2], 0, 2, "gloo"), GroupShape.of([0, 2], 0, 2, "nccl")
    assert chunk_bytes("all_gather", gloo, 8) == chunk_bytes("all_gather", nccl, 8) == (0, 8)
    assert all_reduce_bytes(16, gloo) == all_reduce_bytes(16, nccl) == (0, 16)
    assert chunk_bytes("reduce_scatter", gloo, 8) == (0, 16)


def test_broadcast_parent_is_gloos_binomial_tree():
    assert [broadcast_parent(m, 0, 8) for m in range(1, 8)] == [0, 0, 1, 0, 1, 2, 3]
    assert [broadcast_parent(m, 2, 4) for m in (3, 0, 1)] == [2, 2, 3]  # positions 1, 2, 3 from root 2
