"""An island whose link is cut (issue 38's target, docs/arch/elastic.md): the lighthouse and
islands 0 and 1 run on netlab node 0, island 2 on node 1, joined by a 1 Gbit/s link
(tools/netlab.sh), each island its own `run.sh` job of one rank as a user starts it. After sync 1
(all three), island 2's link is cut (its bridge port down) before it asks for sync 2, and stays
cut for CUT_S. The others drop it at sync 2 (its heartbeats stop) and go on syncing without it;
island 2 waits in its quorum request. Once the link is back, its request reaches the lighthouse,
it is behind the others, takes a live peer's state and rejoins; from that sync on all three hold
the same parameters bit for bit (their checkpoints at the syncs).

Runs only as root with `ip`, `tc` and `unshare`; otherwise skipped with the reason (pytest -ra).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from support import netlab_nodes

from megazpp.analysis.event_reader import read_run
from tests.test_outer_elastic import (
    H,
    finish,
    held,
    snapshot_at,
    start_island,
    start_lighthouse,
    stop_all,
    sync_lines,
    trained_steps,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
NETLAB = REPO / "tools" / "netlab.sh"
PREFIX = f"mzc{os.getpid() % 10000}"
SUBNET = f"10.79.{os.getpid() % 250}"
# The 30 s: far past the heartbeat timeout (1.5 s), so the lighthouse has dropped the
# island long before the link comes back, and the others sync several times without it.
CUT_S = 30.0

pytestmark = [pytest.mark.netlab, pytest.mark.slow]


def _netlab(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NETLAB_PREFIX": PREFIX, "NETLAB_SUBNET": SUBNET}
    return subprocess.run(["bash", str(NETLAB), *args], env=env, text=True, capture_output=True, timeout=60)


def _on(node: int) -> tuple[str, ...]:
    return ("env", f"NETLAB_PREFIX={PREFIX}", f"NETLAB_SUBNET={SUBNET}", "bash", str(NETLAB), "run", str(node))


def _link(node: int, state: str) -> None:
    """Cut (`down`) or restore (`up`) node `node`'s link at the hub's bridge port."""
    subprocess.run(["ip", "-n", f"{PREFIX}_hub", "link", "set", f"port{node}", state], check=True, timeout=30)


@pytest.fixture
def nodes():
    with netlab_nodes(_netlab):
        yield
    assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


K = 6  # island 0 is held at its K-th sync until island 2 asks again (island 1 waits there for it)


def _island(data: Path, island: int, port: int, tmp: Path, node: int, pause_at: str, iters: int):
    """Island `island` on netlab node `node` (its store on that node's address, which the others
    reach), held at `pause_at`."""
    return start_island(
        data,
        island,
        port,
        tmp,
        iters=iters,
        pause_at=pause_at,
        node=_on(node),
        node_env={"MASTER_ADDR": f"{SUBNET}.{node + 1}"},
        lighthouse_host=f"{SUBNET}.1",
    )


def test_an_island_whose_link_is_cut_is_dropped_and_rejoins(nodes, run_sh_data_dir, tmp_path):
    # Sync 1 holds all three whatever their start-up times: island 2 and island 1 start first, island 1
    # held at its start; island 0 starts once both heartbeat, and island 1 is let go once island 0 does
    # (the lighthouse's join timeout then waits for every heartbeating island). One survivor held at
    # its K-th sync holds both (the lighthouse needs 2), so the others neither run past the cut nor
    # meet island 2's request before it arrives.
    lighthouse, port = start_lighthouse(tmp_path, 2, join_ms=120000, node=_on(0))
    data, islands = run_sh_data_dir, list[subprocess.Popen[str]]()
    logs = {i: tmp_path / f"island{i}.log" for i in range(3)}
    lighthouse_log = tmp_path / "lighthouse.log"
    try:
        islands = [
            _island(data, 2, port, tmp_path, 1, "elastic_sync@2", 3 * H),
            _island(data, 1, port, tmp_path, 0, "elastic_start", (K + 1) * H),
        ]
        wait_for("island 2 heartbeats", lambda: "outer: elastic DiLoCo, island 2" in logs[2].read_text(), islands)
        ready1 = held(tmp_path, ["1"], islands)[0]
        islands.append(_island(data, 0, port, tmp_path, 0, f"elastic_sync@{K}", (K + 1) * H))
        wait_for("island 0 heartbeats", lambda: "outer: elastic DiLoCo, island 0" in logs[0].read_text(), islands)
        ready1.unlink()
        ready2 = held(tmp_path, ["2"], islands)[0]  # after sync 1, before its request for sync 2
        asked = "Received quorum request for replica island2"
        asked_before = lighthouse_log.read_text().count(asked)  # its start exchange's and sync 1's
        _link(1, "down")
        cut = time.monotonic()
        ready2.unlink()
        ready0 = held(tmp_path, ["0"], islands)[0]  # syncs 2..K-1 without island 2
        assert "outer sync 2" not in logs[2].read_text()
        wait_for("the cut's end", lambda: time.monotonic() - cut >= CUT_S, islands)
        _link(1, "up")
        wait_for("island 2's request", lambda: lighthouse_log.read_text().count(asked) > asked_before, islands)
        ready0.unlink()
        finish(tmp_path, {"0": islands[2], "1": islands[1], "2": islands[0]})
    finally:
        stop_all(islands, lighthouse)
    outs = {i: log.read_text() for i, log in logs.items()}
    everyone, rejoin = ("0,1,2", "512,512,512"), ("0,1,2", "512,512,0")  # a healed island's interval: 0
    met = {1: everyone, **{s: ("0,1", "512,512") for s in range(2, K)}, K: rejoin, K + 1: everyone}
    for i in (0, 1):
        syncs = sync_lines(outs[i], i)
        assert [(s[0], s[2], s[3]) for s in syncs] == [(str(k), *v) for k, v in met.items()], syncs
        assert "outer: island 2 dropped at outer sync 2 (absent from the quorum: no heartbeat" in outs[i]
        assert "outer: island 2 joined at the start after outer sync 0" in outs[i]
        assert f"outer: island 2 joined at outer sync {K} " in outs[i]
        assert trained_steps(outs[i], (K + 1) * H) == list(range(1, (K + 1) * H + 1))  # every step once
        live = read_run(tmp_path / f"tb{i}", "two-level").scalars["outer/islands_live"].values
        assert list(live) == [3] + [2] * (K - 2) + [3, 3]
    # island 2 waited in its request for sync 2 through the cut; back, it was behind (its count 1),
    # healed from a live peer and met sync K with weight 0, then trained on with the others
    syncs2 = sync_lines(outs[2], 2)
    assert [(s[0], s[1], s[2], s[3]) for s in syncs2] == [
        ("1", "4", *everyone),
        (str(K), "8", *rejoin),
        (str(K + 1), "12", *everyone),
    ]
    assert f"outer: island 2 rejoined at outer sync {K} with island " in outs[2], outs[2][-3000:]
    assert trained_steps(outs[2], 3 * H) == list(range(1, 3 * H + 1))
    # the same parameters and outer snapshot bit for bit: islands 0 and 1 at every sync, island 2 too
    # at the sync it rejoined and the one after (each island's checkpoint at that sync's step)
    for sync in range(1, K + 2):
        saved = {i: snapshot_at(tmp_path, i, sync * H) for i in (0, 1)}
        if sync == 1 or sync >= K:
            saved[2] = snapshot_at(tmp_path, 2, H * {1: 1, K: 2, K + 1: 3}[sync])
        for i, state in saved.items():
            assert state.keys() == saved[0].keys()
            for k in state:
                assert torch.equal(state[k], saved[0][k]), (sync, i, k)
