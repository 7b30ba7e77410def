"""Islands that rejoin and join a running elastic job, as a user runs them (docs/arch/elastic.md):
the lighthouse needs three islands per sync, and islands 0, 1 and 2 start (one rank each).
Island 2 (checkpointing every 2 syncs) is killed after sync 3, held at its next sync (pause point
`elastic_sync`) so the kill lands there whatever the machine's load, and islands 0 and 1 are held
there too. Restarted with the same id, island 2 resumes from its checkpoint of sync 2, one sync
behind, and island 3, an id never seen, starts beside it; each meets the others before its first
inner step (pause point `elastic_join`), so all four ask for sync 4 together: there both
newcomers take the live outer and inner state from a live peer (torchft's checkpoint transport,
over HTTP), trained nothing stale, and every island goes on with them; the others log the join.
Asserted: who met at each sync with which tokens (a newcomer's weighs 0), the rejoin lines,
every island's parameters and outer snapshot equal bit for bit at every sync after it came, and
each survivor trained each of its inner steps once."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from tests.test_outer_elastic import (
    H,
    finish,
    held,
    kill_island,
    release,
    snapshot_at,
    start_island,
    start_lighthouse,
    stop_all,
    sync_lines,
    trained_steps,
    wait_for,
)

ITERS = 6 * H  # the survivors' run: syncs 1..6


@pytest.mark.slow
def test_a_restarted_island_and_a_new_one_take_the_live_state_and_train_on(run_sh_data_dir, tmp_path):
    # The lighthouse needs three islands per sync, so syncs 1..3 are 0, 1, 2 whenever each starts.
    # Sync 4 is asked by all four islands within milliseconds (each held before its request, then
    # let go together); the long join timeout makes the first requests wait for every island that
    # heartbeats (a dead one stops heartbeating), so both newcomers meet the same sync.
    lighthouse, port = start_lighthouse(tmp_path, 3, join_ms=120000)
    islands: list[subprocess.Popen[str]] = []
    data = run_sh_data_dir
    try:
        before_sync_4 = "elastic_sync@4"  # after sync 3 and the next interval's 4 inner steps
        islands = [start_island(data, i, port, tmp_path, iters=ITERS, pause_at=before_sync_4) for i in range(2)]
        islands.append(
            start_island(data, 2, port, tmp_path, "--save-interval", str(2 * H), iters=ITERS, pause_at=before_sync_4)
        )
        held(tmp_path, ["0", "1", "2"], islands)
        kill_island(islands[2])
        log2 = (tmp_path / "island2.log").read_text()
        assert "outer sync 3 at step 12" in log2 and "outer sync 4" not in log2, log2[-3000:]
        # island 2 again, from its checkpoint of sync 2 (step 8), stopping with the others after sync 6;
        # island 3, new; each held before its start exchange (heartbeating), then all four let go together
        again = ["--exit-interval", str(4 * H)]
        islands[2] = start_island(
            data, 2, port, tmp_path, *again, iters=ITERS, log_name="again", pause_at="elastic_join"
        )
        islands.append(start_island(data, 3, port, tmp_path, iters=2 * H, pause_at="elastic_join"))
        release(tmp_path, ["0", "1", "2again", "3"], islands)
        finish(tmp_path, dict(zip(["0", "1", "2again", "3"], islands)))
    finally:
        stop_all(islands, lighthouse)
    outs = {i: (tmp_path / f"island{i}.log").read_text() for i in (0, 1, 3)}
    outs[2] = (tmp_path / "island2again.log").read_text()
    # 4 steps x 4 samples x 32 tokens per island and interval; a healed island's interval: 0
    met = {
        1: ("0,1,2", "512,512,512"),
        2: ("0,1,2", "512,512,512"),
        3: ("0,1,2", "512,512,512"),
        4: ("0,1,2,3", "512,512,0,0"),
        5: ("0,1,2,3", "512,512,512,512"),
        6: ("0,1,2,3", "512,512,512,512"),
    }
    for i in (0, 1):
        syncs = sync_lines(outs[i], i)
        assert [(s[0], s[2], s[3]) for s in syncs] == [(str(k), *v) for k, v in met.items()], syncs
        assert [s[1] for s in syncs] == [str(H * k) for k in met], syncs
        assert "outer: island 3 joined at outer sync 4" in outs[i], outs[i][-3000:]
        assert trained_steps(outs[i], ITERS) == list(range(1, ITERS + 1))
    # island 2: resumed at step 8, rejoined at sync 4 before its first inner step (none trained stale)
    syncs2 = sync_lines(outs[2], 2)
    assert [(s[0], s[1]) for s in syncs2] == [("4", "8"), ("5", "12"), ("6", "16")], syncs2
    assert [(s[2], s[3]) for s in syncs2] == [met[4], met[5], met[6]]
    assert "outer: island 2 rejoined at outer sync 4 with island " in outs[2], outs[2][-3000:]
    syncs3 = sync_lines(outs[3], 3)
    assert [(s[0], s[1]) for s in syncs3] == [("4", "0"), ("5", "4"), ("6", "8")], syncs3
    assert [(s[2], s[3]) for s in syncs3] == [met[4], met[5], met[6]]
    assert "outer: island 3 rejoined at outer sync 4 with island " in outs[3], outs[3][-3000:]
    # each sync's parameters and outer snapshot, saved at the sync's step of each island (the
    # newcomers met sync 4 at their start, where they save nothing)
    at = {4: {0: 16, 1: 16}, 5: {0: 20, 1: 20, 2: 12, 3: 4}, 6: {0: 24, 1: 24, 2: 16, 3: 8}}
    for sync, steps in at.items():
        saved = {i: snapshot_at(tmp_path, i, step) for i, step in steps.items()}
        for i, state in saved.items():
            assert state.keys() == saved[0].keys()
            for k in state:
                assert torch.equal(state[k], saved[0][k]), (sync, i, k)


@pytest.mark.slow
def test_a_two_rank_island_restarted_without_its_checkpoints_heals_rank_by_rank(run_sh_data_dir, tmp_path):
    """Islands of 2 ranks (ZeRO inside each): island 1 is killed after sync 1 and its checkpoints
    are lost; island 0 waits at sync 2 (the lighthouse needs 2). Started again with another model
    by mistake, island 1 stops with one line at its first sync (nothing of island 0's is lost: its
    exchange is redone). Restarted from scratch as it was, island 1 takes at its start (island
    0's sync 2) the live state of island 0, each rank from the same rank of island 0 (both vote
    together, `should_commit`), and both islands hold the same shards at sync 3."""
    lighthouse, port = start_lighthouse(tmp_path, 2)
    islands: list[subprocess.Popen[str]] = []
    data = run_sh_data_dir
    try:
        islands = [start_island(data, i, port, tmp_path, nproc=2, pause_at=None) for i in range(2)]
        log1 = tmp_path / "island1.log"
        wait_for("island 1's first sync", lambda: "outer sync 1 at step 4" in log1.read_text(), islands)
        kill_island(islands[1])
        shutil.rmtree(tmp_path / "ckpt1")
        wrong = start_island(
            data, 1, port, tmp_path, "--ffn-hidden-size", "96", nproc=2, pause_at=None, log_name="wrong"
        )
        assert wrong.wait(timeout=300) != 0
        shutil.rmtree(tmp_path / "ckpt1")
        islands[1] = start_island(data, 1, port, tmp_path, nproc=2, pause_at=None, iters=H, log_name="again")
        finish(tmp_path, {"0": islands[0], "1again": islands[1]})
    finally:
        stop_all(islands, lighthouse)
    out0, out1 = (tmp_path / "island0.log").read_text(), (tmp_path / "island1again.log").read_text()
    wrong_out = (tmp_path / "island1wrong.log").read_text()
    assert "pretrain_gpt.py: error: outer: island 1 cannot take island 0's live state (its shard has " in wrong_out
    assert "every island must run the same model, parallel layout and ZeRO strategy" in wrong_out, wrong_out[-3000:]
    assert [(s[0], s[1], s[2], s[3]) for s in sync_lines(out0, 0)] == [
        ("1", "4", "0,1", "512,512"),
        ("2", "8", "0,1", "512,0"),
        ("3", "12", "0,1", "512,512"),
    ]
    assert [(s[0], s[1], s[2], s[3]) for s in sync_lines(out1, 1)] == [
        ("2", "0", "0,1", "512,0"),
        ("3", "4", "0,1", "512,512"),
    ]
    assert "outer: island 1 rejoined at outer sync 2 with island 0's live state" in out1, out1[-3000:]
    assert trained_steps(out0, 3 * H) == list(range(1, 3 * H + 1))
    for rank in (0, 1):
        for step0, step1 in ((3 * H, H),):  # island 1 met sync 2 at its start (step 0: no checkpoint)
            a, b = snapshot_at(tmp_path, 0, step0, rank), snapshot_at(tmp_path, 1, step1, rank)
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), (rank, step0, k)
