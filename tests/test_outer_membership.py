"""`Membership` when a sync fails (docs/arch/elastic.md), with one-rank islands at the lighthouse.
An island dies inside a sync: island 2 enters the quorum and is killed before the exchange, so
the other two meet a dead peer in their collective. torchft's vote discards the attempt on both,
the sync is redone with a new quorum of the two, and both get the token-weighted mean of their
own pseudo-gradients, bit for bit equal, and of what else the sync averages (`extra`: the inner
optimizer's state). A sync one island commits and another redoes (the vote is agreed inside an
island only): the one that redid it is behind at its retry and heals, and asks for the extra of
the sync the others hold (its number after the heal), so the islands' buffers agree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from support import ROOT, free_port

ISLAND = """
import os, signal, sys, time, torch
from datetime import timedelta
from pathlib import Path
from megazpp.outer.membership import Membership
i, port = int(sys.argv[1]), int(sys.argv[2])
m = Membership(i, f"127.0.0.1:{port}", 2, 0, 1, "127.0.0.1", 60.0, 5.0, torch.device("cpu"))
Path(f"ready{i}").touch()  # heartbeating: wait for the others, so the first quorum holds all three
while not Path("go").exists():
    time.sleep(0.05)
if i == 2:  # in the quorum, then gone before the exchange: the others meet a dead peer
    m._manager.start_quorum(allow_heal=False, timeout=timedelta(seconds=60))
    os.kill(os.getpid(), signal.SIGKILL)
g = torch.full((1000,), float(i + 1))
r = m.average(g, 10 * (i + 1), lambda n: torch.full((3,), 10.0 * (i + 1)))
print("RESULT", r.islands, r.tokens, r.attempts, g[0].item(), g.eq(g[0]).all().item(), flush=True)
print("EXTRA", r.extra[0].item(), r.extra.eq(r.extra[0]).all().item(), r.extra.numel(), flush=True)
m.leave()
"""


SPLIT = """
import sys, time, torch
from pathlib import Path
from megazpp.outer.membership import Membership
i, port = int(sys.argv[1]), int(sys.argv[2])
m = Membership(i, f"127.0.0.1:{port}", 2, 0, 1, "127.0.0.1", 60.0, 5.0, torch.device("cpu"))
w = torch.zeros(4)  # the islands' common parameters
m.share(lambda: {"island": i, "syncs": m.syncs, "w": w}, lambda s: w.copy_(s["w"]))
if i == 1:  # island 1's other rank lost its peer group after the exchange: island 1 alone votes no, once
    vote = m._manager.should_commit
    def failing(timeout=None):
        m._manager.should_commit = vote
        m._manager.report_error(RuntimeError("rank 1 of island 1: its peer group failed"))
        return vote(timeout)
    m._manager.should_commit = failing
Path(f"ready{i}").touch()
while not Path("go").exists():
    time.sleep(0.05)
asked = []
def extra(n):  # every second sync averages more (as outer.optimizer_state_every 2 does)
    asked.append(n)
    return torch.full((2,), float(n)) if n % 2 == 0 else None
while m.syncs < 2:
    g = torch.full((4,), float(10 * m.syncs + i + 1))
    r = m.average(g, 10 * (i + 1), extra)
    w.add_(g)  # the outer step
    more = None if r.extra is None else r.extra.tolist()
    print("SYNC", m.syncs, r.islands, r.tokens, r.attempts, r.healed_from, w.tolist(), asked, more, flush=True)
m.leave()
"""


def run_islands(tmp_path, script: str, n: int) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]]:
    """The lighthouse (2 islands per sync) and `n` islands running `script`, let go together
    once all heartbeat; the outputs of the first two (with three, the last one kills itself)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "lighthouse.log").open("w")
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "megazpp.launch.lighthouse", "--min-islands", "2", "--port", str(port)]
        + ["--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "30000"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    islands: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 120
        while "listening at" not in (tmp_path / "lighthouse.log").read_text():
            assert lighthouse.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
            time.sleep(0.05)
        islands = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(i), str(port)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        while not all((tmp_path / f"ready{i}").exists() for i in range(n)):
            assert all(p.poll() is None for p in islands) and time.monotonic() < deadline + 120, "an island ended"
            time.sleep(0.05)
        (tmp_path / "go").touch()
        return islands, [p.communicate(timeout=180) for p in islands[:2]]
    finally:
        for p in islands:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.terminate()
        lighthouse.wait(timeout=30)


@pytest.mark.slow
def test_an_island_killed_inside_the_sync_is_left_out_of_the_redone_exchange(tmp_path):
    islands, outs = run_islands(tmp_path, ISLAND, 3)
    assert islands[2].returncode == -9, islands[2].communicate()[1][-3000:]
    # island 0 trained 10 tokens with pseudo-gradient 1, island 1 20 with 2: weights 1/3, 2/3
    mean = (torch.tensor(1.0) * (10 / 30) + torch.tensor(2.0) * (20 / 30)).item()
    for i, (out, err) in enumerate(outs):
        assert islands[i].returncode == 0, err[-3000:]
        assert f"RESULT (0, 1) (10, 20) 2 {mean} True" in out, out + err[-3000:]
        extra = (torch.tensor(10.0) * (10 / 30) + torch.tensor(20.0) * (20 / 30)).item()
        assert f"EXTRA {extra} True 3" in out, out
        assert "outer sync 1 failed" in err and "redone with a new quorum" in err, err[-3000:]


@pytest.mark.slow
def test_a_sync_one_island_committed_and_another_redid_is_repaired_by_a_heal(tmp_path):
    islands, outs = run_islands(tmp_path, SPLIT, 2)
    for p, (_, err) in zip(islands, outs):
        assert p.returncode == 0, err[-3000:]
    (out0, _), (out1, err1) = outs
    # sync 1: island 0 trained 10 tokens (g 1), island 1 20 (g 2), each weighted in fp32, then summed
    mean1 = torch.full((4,), 1.0).mul_(10 / 30) + torch.full((4,), 2.0).mul_(20 / 30)
    w1 = torch.zeros(4).add_(mean1)
    # island 0 committed sync 1, then sync 2 with island 1 healing in it (its retry of sync 1)
    assert f"SYNC 1 (0, 1) (10, 20) 1 None {w1.tolist()} [1] None" in out0, out0
    w2 = w1.add(torch.full((4,), 11.0).mul_(1.0)).tolist()
    assert f"SYNC 2 (0, 1) (10, 0) 1 None {w2} [1, 2] [2.0, 2.0]" in out0, out0
    # island 1 voted no; its second attempt found it behind: it took island 0's state, added nothing
    assert "outer sync 1 failed" in err1 and "redone with a new quorum" in err1, err1[-3000:]
    # (sync 1's extra asked at its first attempt, sync 2's at the retry after the heal)
    assert out1.splitlines() == [f"SYNC 2 (0, 1) (10, 0) 2 0 {w2} [1, 2] [2.0, 2.0]"], out1 + err1[-3000:]
