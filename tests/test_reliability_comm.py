"""Hangs: a peer that stops participating or dies makes the other rank fail within the process
group's timeout, with a CommunicationError naming the operation and its tag (megazpp's
`comm` layer), not wait forever."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megazpp.launch.local_ranks import run_ranks

TIMEOUT_S = 4


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: it takes part in nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.01)


def _peer_hangs_then_dies(report: str) -> None:
    """Rank 1 hangs until rank 0's first collective has failed, then dies; rank 0 starts its
    second collective once rank 1 is gone. Each moment is a file, not a guess at the other
    rank's speed (on loaded cores one rank can start seconds after the other). The short
    timeout is that of a group made once both ranks are up (start-up keeps run_ranks' long one)."""
    import torch.distributed as dist

    from megazpp.errors import CommunicationError
    from megazpp.parallel import comm

    hung_over, dead = Path(f"{report}.hung_over"), Path(f"{report}.rank1_pid")
    dist.barrier()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
    if dist.get_rank() == 1:
        Path(f"{dead}.tmp").write_text(str(os.getpid()))
        os.replace(f"{dead}.tmp", dead)  # whole when rank 0 reads it
        _wait_for(hung_over)  # never joins the first collective: rank 0's must time out meanwhile
        os._exit(0)  # then dies without leaving the process group
    events = []
    for tag, async_op in (("test/hung_peer", False), ("test/dead_peer", True)):
        start = time.monotonic()
        try:
            work = comm.all_reduce(torch.ones(4), group=group, tag=tag, async_op=async_op)
            if async_op:
                work.wait()
            events.append({"tag": tag, "error": None})
        except CommunicationError as exc:
            events.append({"tag": tag, "error": str(exc), "seconds": time.monotonic() - start})
        if tag == "test/hung_peer":
            hung_over.write_text("")
            _wait_for(dead)
            while not _gone(int(dead.read_text())):  # rank 1 dies before the second collective
                time.sleep(0.01)
    Path(report).write_text(json.dumps(events))


def test_a_dead_or_hung_peer_is_named_not_waited_for(tmp_path):
    report = tmp_path / "rank0.json"
    with pytest.raises(RuntimeError, match="rank 1 exited without a result"):
        run_ranks(_peer_hangs_then_dies, 2, str(report))
    hung, dead = json.loads(report.read_text())
    assert hung["error"].startswith(
        "all_reduce (tag test/hung_peer) on rank 0 failed: a peer rank died or the collective timed out"
    )
    # it failed at the timeout, not before, and not at the default 30 minutes (the slack is a
    # loaded machine's: the process group's timer thread waits for a core like everything else)
    assert TIMEOUT_S - 1 < hung["seconds"] < TIMEOUT_S + 120
    # the asynchronous form reports at wait(), equally named
    assert dead["error"].startswith("all_reduce (tag test/dead_peer) on rank 0 failed")
    assert dead["seconds"] < TIMEOUT_S + 120


def test_pretrain_passes_the_distributed_timeout(monkeypatch):
    import pretrain_gpt
    from megazpp.config.load import load_config

    seen = {}
    monkeypatch.setattr(pretrain_gpt.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        pretrain_gpt.dist, "init_process_group", lambda backend, timeout: seen.update(backend=backend, timeout=timeout)
    )
    cfg = load_config(["--distributed-timeout-minutes", "3"])
    assert pretrain_gpt.init_distributed(cfg, 2, "gloo")
    assert seen == {"backend": "gloo", "timeout": timedelta(minutes=3)}
