"""Where elastic islands read in the data, as a user runs them (docs/arch/elastic.md, "Data
positions"): two one-rank islands (`run.sh`, gloo, the lighthouse needs both), island 1 with twice
island 0's global batch, one job-wide train dataset (`--outer-train-samples`, `start_island`'s). They meet before
their first inner step and claim disjoint runs of the job's global sample order. Island 1 is
killed before its second sync, after training its second interval (held at the pause point
`elastic_sync@2`, so the kill lands there whatever the machine's load). A new island with another
train dataset stops there with one line, and island 0's sync is redone without it. Island 1,
restarted from its checkpoint of sync 1, meets island 0's sync 2 before its first inner step: its
lost interval's claim is re-queued (logged with the range) and claimed first. Asserted from the
logs: no position is merged twice, the merged claims and the last layout's cover the positions
handed out without a hole, the re-queued range is claimed again, and each island's
`consumed_samples` is what it read."""

from __future__ import annotations

import re

import pytest
import torch

from megazpp.checkpoint.format import rank_file_name
from megazpp.data.global_order import GlobalOrder
from tests.test_outer_elastic import (
    TRAIN_SAMPLES,
    H,
    finish,
    held,
    kill_island,
    start_island,
    start_lighthouse,
    stop_all,
    sync_lines,
)

Range = tuple[int, int]


def ranges(text: str) -> list[Range]:
    return [(int(lo), int(hi)) for lo, hi in re.findall(r"\[(\d+), (\d+)\)", text)]


def layouts(out: str) -> list[tuple[str, dict[int, list[Range]]]]:
    """(where, island -> claimed ranges) of each layout the log shows, in order."""
    found = []
    for where, laid in re.findall(r"outer: samples claimed after (.+?): (.+)$", out, flags=re.M):
        claims = {int(i): ranges(r) for i, r in re.findall(r"island (\d+) ((?:\[\d+, \d+\)\+?)+|none)", laid)}
        found.append((where, claims))
    return found


def requeued(out: str) -> list[tuple[int, list[Range], str]]:
    """(island, ranges, where) of each re-queue line."""
    lines = re.findall(r"outer: samples (\S.*?) of island (\d+)'s claim were not merged at (.+?) \(", out)
    return [(int(i), ranges(r), where) for r, i, where in lines]


def positions(rs: list[Range]) -> list[int]:
    return [p for lo, hi in rs for p in range(lo, hi)]


def consumed(tmp, island: int, iteration: int) -> tuple[int, dict]:
    state = torch.load(
        tmp / f"ckpt{island}" / f"iter_{iteration:07d}" / rank_file_name(0, 0, 0),
        map_location="cpu",
        weights_only=False,
    )
    return int(state["consumed_samples"]), state["engine"]["outer"]["elastic"]


@pytest.mark.slow
def test_islands_read_disjoint_samples_and_a_dead_islands_interval_is_requeued(run_sh_data_dir, tmp_path):
    lighthouse, port = start_lighthouse(tmp_path, 2)
    data, islands = run_sh_data_dir, []
    try:
        islands = [start_island(data, 0, port, tmp_path, iters=4 * H, pause_at=None)]
        double = ["--global-batch-size", "8"]
        islands.append(start_island(data, 1, port, tmp_path, *double, iters=4 * H, pause_at="elastic_sync@2"))
        held(tmp_path, ["1"], islands)
        kill_island(islands[1])
        # a new island with another train dataset: it stops with one line, island 0's sync is redone
        wrong = start_island(data, 2, port, tmp_path, "--outer-train-samples", "128", iters=4 * H, pause_at=None)
        assert wrong.wait(timeout=300) != 0
        # from its checkpoint of sync 1 (step 4), to step 12: syncs 2, 3, 4 with island 0
        again = [*double, "--exit-interval", str(3 * H)]
        islands[1] = start_island(data, 1, port, tmp_path, *again, iters=4 * H, log_name="again", pause_at=None)
        finish(tmp_path, {"0": islands[0], "1again": islands[1]})
    finally:
        stop_all(islands, lighthouse)
    out0 = (tmp_path / "island0.log").read_text()
    out1 = (tmp_path / "island1again.log").read_text()
    wrong_out = (tmp_path / "island2.log").read_text()
    assert f"outer: the islands' train datasets differ (island 0: {TRAIN_SAMPLES}, island 2: 128 samples)" in wrong_out
    assert "give every island the same outer.train_samples (--outer-train-samples)" in wrong_out
    assert "outer: island 0: outer sync 2 failed (" in out0 and "redone with a new quorum" in out0, out0[-3000:]
    # 4 steps x 4 samples of island 0 and 4 x 8 of island 1 per interval, 32 tokens each
    assert [s[:2] + s[3:] for s in sync_lines(out0, 0)] == [
        ("1", "4", "512,1024"),
        ("2", "8", "512,0"),
        ("3", "12", "512,1024"),
        ("4", "16", "512,1024"),
    ], sync_lines(out0, 0)
    laid = layouts(out0)
    assert [w for w, _ in laid] == ["the start after outer sync 0", *(f"outer sync {s}" for s in (1, 2, 3, 4))]
    assert "outer: island 0 starts with islands " in out0
    # each claim is H global batches of its island
    for _, claims in laid:
        assert {i: len(positions(rs)) for i, rs in claims.items()} == {0: 4 * H, 1: 8 * H}
    # island 1's second interval (claimed after sync 1) was trained by its killed run, never merged
    back = requeued(out0)
    assert back == [(1, laid[1][1][1], "outer sync 2")], back
    assert f"samples {'+'.join(f'[{a}, {b})' for a, b in back[0][1])} of island 1's claim were not merged" in out1
    # merged: each layout's claims but the re-queued one; no position merged twice, none skipped
    merged = [positions(rs) for _, claims in laid[:-1] for rs in claims.values()]
    merged.remove(positions(back[0][1]))
    flat = [p for m in merged for p in m]
    assert len(flat) == len(set(flat)), "a position merged twice"
    last = [p for rs in laid[-1][1].values() for p in positions(rs)]
    assert sorted(flat + last) == list(range(len(flat) + len(last))), "a position skipped"
    assert set(positions(back[0][1])) <= set(positions(laid[2][1][0]) + positions(laid[2][1][1]))  # re-claimed
    # and so no sample of a pass is merged twice (the order is one permutation of the dataset per pass)
    samples = GlobalOrder(TRAIN_SAMPLES, seed=1234).samples(flat)
    assert len(set(samples)) == len(samples)
    # consumed_samples: what each island read; its checkpoint holds the plan it read from
    assert consumed(tmp_path, 0, 4 * H)[0] == 4 * H * 4
    count, elastic = consumed(tmp_path, 1, 3 * H)
    assert count == 3 * H * 8 and elastic["read"] == 0 and elastic["syncs"] == 4 and elastic["starts"] == 1
    assert {int(i): [tuple(r) for r in rs] for i, rs in elastic["plan"]["claims"].items()} == laid[-1][1]
