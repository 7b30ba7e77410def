"""Where elastic islands read in the data, as a user runs them (docs/arch/elastic.md, "Data
positions"): two one-rank islands (`run.sh`, gloo, the lighthouse needs both), island 1 with twice
island 0's global batch, one job-wide train dataset (`--outer-train-samples`, `start_island`'s).
They meet before their first inner step and claim disjoint runs of the job's global sample order.
Island 1 is killed before its second sync, after training its second interval (held at the pause
point `elastic_sync@2`, so the kill lands there whatever the machine's load). A new island with
another train dataset stops there with one line, and island 0's sync is redone without it.
Island 1, restarted from its checkpoint of sync 1, meets island 0's sync 2 before its first inner
step: its lost interval's claim is re-queued (logged with the range) and claimed first. Both
then stop after sync 3 and restart from their checkpoints: they meet at a start exchange (no
outer step), which re-queues both claims, and train on to sync 4. Asserted from the logs: no
position is merged twice, the merged claims and the last layout's cover the positions handed
out without a hole, each re-queued range is claimed again, each island's `consumed_samples` is
what it read, and the islands' parameters agree after the restart."""

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
    snapshot_at,
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
def test_islands_read_disjoint_samples_a_dead_islands_interval_is_requeued_and_a_full_restart_resumes(
    run_sh_data_dir, tmp_path
):
    lighthouse, port = start_lighthouse(tmp_path, 2)
    data, started = run_sh_data_dir, []  # every island started, stopped at the end whatever happens
    double = ["--global-batch-size", "8"]
    try:
        # island 0 stops after sync 3 (its step 12), island 1 at the pause before its sync 2
        first = ["--exit-interval", str(3 * H)]
        islands = [start_island(data, 0, port, tmp_path, *first, iters=4 * H, pause_at=None)]
        islands.append(start_island(data, 1, port, tmp_path, *double, iters=4 * H, pause_at="elastic_sync@2"))
        started += islands
        held(tmp_path, ["1"], islands)
        kill_island(islands[1])
        # a new island with another train dataset: it stops with one line, island 0's sync is redone
        wrong = start_island(data, 2, port, tmp_path, "--outer-train-samples", "128", iters=4 * H, pause_at=None)
        started.append(wrong)
        assert wrong.wait(timeout=300) != 0
        # island 1 from its checkpoint of sync 1 (step 4) to step 8: syncs 2 and 3 with island 0
        again = [*double, "--exit-interval", str(2 * H)]
        islands[1] = start_island(data, 1, port, tmp_path, *again, iters=4 * H, log_name="again", pause_at=None)
        started.append(islands[1])
        finish(tmp_path, {"0": islands[0], "1again": islands[1]})
        # both stopped after sync 3: a full restart, each from its checkpoint of sync 3, to sync 4
        last = [*double, "--exit-interval", str(3 * H)]
        islands = [start_island(data, 0, port, tmp_path, iters=4 * H, log_name="restart", pause_at=None)]
        islands.append(start_island(data, 1, port, tmp_path, *last, iters=4 * H, log_name="restart", pause_at=None))
        started += islands
        finish(tmp_path, {"0restart": islands[0], "1restart": islands[1]})
    finally:
        stop_all(started, lighthouse)
    out0, again0 = (tmp_path / "island0.log").read_text(), (tmp_path / "island0restart.log").read_text()
    out1 = (tmp_path / "island1again.log").read_text()
    wrong_out = (tmp_path / "island2.log").read_text()
    assert f"outer: the islands' train datasets differ (island 0: {TRAIN_SAMPLES}, island 2: 128 samples)" in wrong_out
    assert "give every island the same outer.train_samples (--outer-train-samples)" in wrong_out
    assert "outer: island 0: outer sync 2 failed (" in out0 and "redone with a new quorum" in out0, out0[-3000:]
    # 4 steps x 4 samples of island 0 and 4 x 8 of island 1 per interval, 32 tokens each
    assert [s[:2] + s[3:] for s in sync_lines(out0 + again0, 0)] == [
        ("1", "4", "512,1024"),
        ("2", "8", "512,0"),
        ("3", "12", "512,1024"),
        ("4", "16", "512,1024"),
    ], sync_lines(out0 + again0, 0)
    assert "outer: island 0 starts with islands 0,1 after outer sync 0 (none of them trained since" in out0
    assert "outer: island 0 starts with islands 0,1 after outer sync 3 (none of them trained since" in again0
    laid = layouts(out0 + again0)
    wheres = ["the start after outer sync 0", "outer sync 1", "outer sync 2", "outer sync 3"]
    assert [w for w, _ in laid] == [*wheres, "the start after outer sync 3", "outer sync 4"]
    for _, claims in laid:  # each claim is H global batches of its island
        assert {i: len(positions(rs)) for i, rs in claims.items()} == {0: 4 * H, 1: 8 * H}
    # island 1's second interval (claimed after sync 1) was trained by its killed run, never merged;
    # after the full stop, both claims of sync 3 (read by the stopped runs, never merged)
    back = requeued(out0 + again0)
    assert back == [
        (1, laid[1][1][1], "outer sync 2"),
        (0, laid[3][1][0], "the start after outer sync 3"),
        (1, laid[3][1][1], "the start after outer sync 3"),
    ], back
    assert f"samples {'+'.join(f'[{a}, {b})' for a, b in back[0][1])} of island 1's claim were not merged" in out1
    # merged: each layout's claims but the re-queued ones; no position merged twice, none skipped
    merged = [positions(rs) for _, claims in laid[:-1] for rs in claims.values()]
    for _, rs, _ in back:
        merged.remove(positions(rs))
    flat = [p for m in merged for p in m]
    assert len(flat) == len(set(flat)), "a position merged twice"
    final = [p for rs in laid[-1][1].values() for p in positions(rs)]
    assert sorted(flat + final) == list(range(len(flat) + len(final))), "a position skipped"
    for k, (_, rs, _) in [(2, back[0]), (4, back[1]), (4, back[2])]:  # each claimed again first
        assert set(positions(rs)) <= {p for r in laid[k][1].values() for p in positions(r)}
    # and so no sample of a pass is merged twice (the order is one permutation of the dataset per pass)
    samples = GlobalOrder(TRAIN_SAMPLES, seed=1234).samples(flat)
    assert len(set(samples)) == len(samples)
    # consumed_samples: what each island read; its checkpoint holds the plan it read from
    assert consumed(tmp_path, 0, 4 * H)[0] == 4 * H * 4
    count, elastic = consumed(tmp_path, 1, 3 * H)
    assert count == 3 * H * 8 and elastic["read"] == 0 and elastic["syncs"] == 4 and elastic["starts"] == 2
    assert {int(i): [tuple(r) for r in rs] for i, rs in elastic["plan"]["claims"].items()} == laid[-1][1]
    # after the full restart both islands hold the same parameters at sync 4
    a, b = snapshot_at(tmp_path, 0, 4 * H), snapshot_at(tmp_path, 1, 3 * H)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
