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


def _peer_hangs_then_dies(report: str) -> None:
    import torch.distributed as dist

    from megazpp.errors import CommunicationError
    from megazpp.parallel import comm

    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S + 1)  # never joins: rank 0's collective must time out meanwhile
        os._exit(0)  # then dies without leaving the process group
    events = []
    for tag, async_op in (("test/hung_peer", False), ("test/dead_peer", True)):
        start = time.monotonic()
        try:
            work = comm.all_reduce(torch.ones(4), tag=tag, async_op=async_op)
            if async_op:
                work.wait()
            events.append({"tag": tag, "error": None})
        except CommunicationError as exc:
            events.append({"tag": tag, "error": str(exc), "seconds": time.monotonic() - start})
        if tag == "test/hung_peer":
            time.sleep(2)  # let rank 1 die before the second collective
    Path(report).write_text(json.dumps(events))


def test_a_dead_or_hung_peer_is_named_not_waited_for(tmp_path):
    report = tmp_path / "rank0.json"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited without a result"):
        run_ranks(_peer_hangs_then_dies, 2, str(report), timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < 60
    hung, dead = json.loads(report.read_text())
    assert hung["error"].startswith(
        "all_reduce (tag test/hung_peer) on rank 0 failed: a peer rank died or the collective timed out"
    )
    assert TIMEOUT_S - 1 < hung["seconds"] < TIMEOUT_S + 10
    # the asynchronous form reports at wait(), equally named
    assert dead["error"].startswith("all_reduce (tag test/dead_peer) on rank 0 failed")
    assert dead["seconds"] < TIMEOUT_S + 10


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
