"""The process-group backend and each rank's device (megazpp/parallel/device.py): the rule for
every node shape, and its refusals as a user meets them, one line from run.sh's check before any
rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megazpp.errors import ConfigError
from megazpp.parallel.device import rank_device, resolve_backend

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "requested,ranks,gpus,backend",
    [
        ("auto", 1, 0, "gloo"),
        ("auto", 4, 0, "gloo"),
        ("gloo", 4, 0, "gloo"),
        ("auto", 8, 8, "nccl"),
        ("nccl", 2, 8, "nccl"),
        ("auto", 1, 1, "nccl"),
        ("gloo", 4, 1, "gloo"),
        ("gloo", 2, 2, "gloo"),
    ],
)
def test_backend_for_each_node_shape(requested, ranks, gpus, backend):
    assert resolve_backend(requested, ranks, gpus) == backend


@pytest.mark.parametrize(
    "requested,ranks,gpus,message",
    [
        ("nccl", 1, 0, "parallel.distributed_backend = nccl: NCCL needs CUDA ranks and this machine has no usable GPU"),
        (
            "nccl",
            4,
            1,
            "parallel.distributed_backend = nccl: 4 ranks per node on 1 GPU(s) would put several ranks "
            "on one GPU, which NCCL refuses; pass --distributed-backend gloo",
        ),
        ("auto", 3, 2, "start at most 2 ranks per node"),
        ("mpi", 1, 0, "parallel.distributed_backend = 'mpi': expected auto, nccl or gloo"),
    ],
)
def test_backend_refusals_name_the_key_and_the_way_out(requested, ranks, gpus, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_backend(requested, ranks, gpus)


def test_ranks_share_gpus_round_robin():
    assert [rank_device(r, 1) for r in range(3)] == [torch.device("cuda", 0)] * 3
    assert [rank_device(r, 2).index for r in range(4)] == [0, 1, 0, 1]
    assert rank_device(5, 0) == torch.device("cpu")


def _startup(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "megazpp.training.startup", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_sh_check_refuses_nccl_on_a_cpu_machine_in_one_line():
    """run.sh runs this check once per job, before torchrun starts a rank."""
    proc = _startup("--world-size", "2", "--ranks-on-node", "2", "--node-rank", "0", "--distributed-backend", "nccl")
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "parallel.distributed_backend = nccl: NCCL needs CUDA ranks" in lines[0]
    # gloo passes the backend check and the run stops at the next one (no data given here)
    ok = _startup("--world-size", "2", "--ranks-on-node", "2", "--node-rank", "0", "--distributed-backend", "gloo")
    assert "data.data_path is empty" in ok.stderr and "distributed_backend" not in ok.stderr, ok.stderr
