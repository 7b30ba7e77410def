"""The elastic islands' data plan and the job's global sample order (docs/arch/elastic.md), without
processes: which positions each island claims at each exchange, what is re-queued and where it
goes, and that the order is one permutation of the dataset per pass whatever the layout. The
processes' side (islands that start alike, die and come back): tests/test_outer_elastic_data.py."""

from __future__ import annotations

from megazpp.data.global_order import BLOCK_SAMPLES, GlobalOrder, rank_micro_batches
from megazpp.outer.data_plan import DataPlan


def covered(ranges: list[tuple[int, int]]) -> list[int]:
    return [p for lo, hi in ranges for p in range(lo, hi)]


def test_islands_that_start_together_claim_disjoint_runs_in_quorum_order():
    plan = DataPlan()
    lines = plan.lay_out([1, 0, 2], [0, 0, 0], [8, 8, 24], "the start after outer sync 0")
    assert plan.claims == {1: [(0, 8)], 0: [(8, 16)], 2: [(16, 40)]}
    assert lines == [
        "outer: samples claimed after the start after outer sync 0: "
        "island 1 [0, 8), island 0 [8, 16), island 2 [16, 40)"
    ]
    assert plan.positions(2, 16, 8) == list(range(32, 40))
    assert plan.positions(2, 20, 8) is None  # past its claim


def test_a_dead_islands_claim_is_requeued_and_claimed_first_split_as_needed():
    plan = DataPlan()
    plan.lay_out([0, 1, 2], [0, 0, 0], [8, 8, 24], "the start after outer sync 0")
    # island 2 died in its interval: 0 and 1 merged theirs, 2's [16, 40) goes back, oldest first
    lines = plan.lay_out([0, 1], [256, 256], [8, 16], "outer sync 1")
    assert lines[0] == (
        "outer: samples [16, 40) of island 2's claim were not merged at outer sync 1 (its island was absent): re-queued"
    )
    assert plan.claims == {0: [(16, 24)], 1: [(24, 40)]}
    assert plan.pending == [] and plan.next == 40
    # island 1 comes back at its start (tokens 0): its claim [24, 40) was trained by its lost run
    # and not merged, so it goes back and is claimed again; island 3 is new
    lines = plan.lay_out([0, 1, 3], [256, 0, 0], [8, 16, 12], "outer sync 2")
    assert (
        "[24, 40) of island 1's claim were not merged at outer sync 2 (its island trained none of it since)" in lines[0]
    )
    assert plan.claims[0] == [(24, 32)]
    assert plan.claims[1] == [(32, 48)]  # the rest of the re-queued range, then fresh ones: one run
    assert plan.claims[3] == [(48, 60)]
    # every position below `next` is either merged once, claimed now, or pending
    merged = [(0, 8), (8, 16), (16, 24)]
    now = [r for rs in plan.claims.values() for r in rs]
    assert sorted(covered(merged + now + plan.pending)) == list(range(plan.next))


def test_the_plan_survives_a_checkpoint_as_plain_values():
    plan = DataPlan()
    plan.lay_out([0, 1], [0, 0], [8, 8], "the start after outer sync 0")
    plan.lay_out([0], [256], [4], "outer sync 1")  # island 1 absent: half its claim stays pending
    again = DataPlan.from_state(plan.state())
    assert again == plan and again.pending == [(12, 16)] and again.claims == {0: [(8, 12)]}


def test_the_global_order_is_one_permutation_per_pass_and_layout_independent():
    total = BLOCK_SAMPLES + 1000  # a full block and a short one
    order = GlobalOrder(total, seed=1234)
    first = order.samples(range(total))
    assert sorted(first) == list(range(total))
    assert first != list(range(total))
    second = order.samples(range(total, 2 * total))
    assert sorted(second) == list(range(total)) and second != first  # the next pass, shuffled anew
    # any reader of position p sees the same sample: in pieces, out of order, from another object
    again = GlobalOrder(total, seed=1234)
    assert again.samples([total - 1, 5, BLOCK_SAMPLES]) == [first[total - 1], first[5], first[BLOCK_SAMPLES]]
    assert GlobalOrder(total, seed=99).samples(range(16)) != first[:16]


def test_an_islands_ranks_split_its_global_batch_as_the_sampler_splits_a_global_micro_step():
    """2 DP ranks, micro-batch 2, 2 micro-batches per step: rank r takes the r-th slice of each
    global micro-step (as `PretrainingSampler` does), so the ranks partition the batch."""
    batch = list(range(100, 108))
    ranks = [rank_micro_batches(batch, 2, r, 2) for r in (0, 1)]
    assert ranks == [[[100, 101], [104, 105]], [[102, 103], [106, 107]]]
    assert sorted(i for r in ranks for mb in r for i in mb) == batch
