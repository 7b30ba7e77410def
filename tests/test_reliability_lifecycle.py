"""A job's life at its ends, tried as a user would: ranks die with their launcher (`kill -9`
of `run.sh`'s launcher leaves no rank training), and a job that finished exits 0 also under
load (its process groups, and gloo's threads, end before the interpreter does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megazpp.training.checkpoint import (LATEST_FILE, expected_rank_files, read_metadata,
                                         verify_checksum)
from test_reliability_restart import ROOT, free_port
from test_reliability_signals import LONG, run_sh, run_sh_data
from test_training_pretrain import tiny_args


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Running (a zombie is dead: whoever adopted it may not reap it at once)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_latest_is_complete(save: Path) -> str | None:
    """`latest` names a checkpoint whose every rank file is there and matches its checksum."""
    if not (save / LATEST_FILE).exists():
        return None
    path = save / (save / LATEST_FILE).read_text().strip()
    metadata = read_metadata(path)
    for name in expected_rank_files(metadata):
        verify_checksum(path / name, metadata)
    return path.name


@pytest.mark.slow
def test_kill_9_of_the_launcher_takes_the_ranks_with_it(tmp_path, tiny_indexed_prefix,
                                                         tiny_tokenizer_model):
    data = run_sh_data(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model)
    save = tmp_path / "ckpt"
    # a save after every step: the kill is likely to land in one
    run = run_sh(tmp_path, data, "--train-iters", LONG, "--save", str(save), "--save-interval",
                 "1", env_extra={})
    run.wait_for(r"^iter +3/")
    launcher = run.proc.pid  # run.sh execs the launcher
    ranks = children(launcher)
    assert len(ranks) == 2, ranks
    os.kill(launcher, signal.SIGKILL)
    run.proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    try:
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in ranks), f"ranks {ranks} outlived their launcher"
    finally:  # never leave orphans training
        for pid in filter(alive, ranks):
            os.kill(pid, signal.SIGKILL)
    assert assert_latest_is_complete(save) is not None  # step 3 was saved before the kill
