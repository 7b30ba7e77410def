"""`Membership` when an island dies inside a sync (docs/arch/elastic.md): three one-rank islands
at the lighthouse; island 2 enters the quorum and is killed before the exchange, so the other
two meet a dead peer in their collective. torchft's vote discards the attempt on both, the sync
is redone with a new quorum of the two, and both get the token-weighted mean of their own
pseudo-gradients, bit for bit equal."""

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
m = Membership(i, f"127.0.0.1:{port}", 2, 0, 1, "127.0.0.1", 60.0, 5.0)
Path(f"ready{i}").touch()  # heartbeating: wait for the others, so the first quorum holds all three
while not Path("go").exists():
    time.sleep(0.05)
if i == 2:  # in the quorum, then gone before the exchange: the others meet a dead peer
    m._manager.start_quorum(allow_heal=False, timeout=timedelta(seconds=60))
    os.kill(os.getpid(), signal.SIGKILL)
g = torch.full((1000,), float(i + 1))
r = m.average(g, 10 * (i + 1))
print("RESULT", r.islands, r.tokens, r.attempts, g[0].item(), g.eq(g[0]).all().item(), flush=True)
m.leave()
"""


@pytest.mark.slow
def test_an_island_killed_inside_the_sync_is_left_out_of_the_redone_exchange(tmp_path):
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
                [sys.executable, "-c", ISLAND, str(i), str(port)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
            assert all(p.poll() is None for p in islands) and time.monotonic() < deadline + 120, "an island ended"
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=180) for p in islands[:2]]
        assert islands[2].wait(timeout=60) == -9, islands[2].communicate()[1][-3000:]
    finally:
        for p in islands:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    # island 0 trained 10 tokens with pseudo-gradient 1, island 1 20 with 2: weights 1/3, 2/3
    mean = (torch.tensor(1.0) * (10 / 30) + torch.tensor(2.0) * (20 / 30)).item()
    for i, (out, err) in enumerate(outs):
        assert islands[i].returncode == 0, err[-3000:]
        assert f"RESULT (0, 1) (10, 20) 2 {mean} True" in out, out + err[-3000:]
        assert "outer sync 1 failed" in err and "redone with a new quorum" in err, err[-3000:]
