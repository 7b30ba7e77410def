"""Multi-node launches without a cluster: two netlab nodes (network namespaces, tools/netlab.sh)
run the real run.sh (1) by hand with NNODES/NODE_RANK/MASTER_ADDR set, (2) as the tasks of a
faked SLURM job step, (3) from tools/launch_hosts.sh through a stand-in for ssh that runs the
command line inside the named node; (2) and (3) must log exactly the losses of (1). Then the
launcher's failure path: one host fails, the other (real run.sh, waiting for its peer) is
stopped and the launcher exits non-zero.

Runs only as root with `ip`, `tc` and `unshare`; otherwise skipped with the reason (pytest -ra).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import finish_all
from support import TINY_MODEL_FLAGS, netlab_nodes

from megazpp.analysis.event_reader import read_run

REPO = Path(__file__).resolve().parents[1]
NETLAB = REPO / "tools" / "netlab.sh"
PREFIX, SUBNET = "mz23", "10.77.23"
HOSTS = [f"{PREFIX}-node0", f"{PREFIX}-node1"]
RUN_TIMEOUT_S = 420
FLAGS = [
    *TINY_MODEL_FLAGS,
    "--global-batch-size",
    "8",
    "--train-iters",
    "3",
    "--lr-warmup-iters",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
]
# Stand-in for `ssh HOST CMDLINE`: options skipped, HOST-node<i> -> netlab node i.
FAKE_SSH = """#!/usr/bin/env bash
while [ "${1#-}" != "$1" ]; do shift 2; done
host=$1; shift
if [ "$host" = "${FAIL_HOST:-}" ]; then sleep "${FAIL_AFTER_S:-3}"; echo "$host: simulated failure"; exit 1; fi
exec bash "$NETLAB" run "${host##*-node}" bash -c "$*"
"""


pytestmark = pytest.mark.netlab  # skipped with the reason where netlab cannot run (conftest)


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any launch variables of its own (a CI job may run
    under SLURM), with this checkout and interpreter, so run.sh installs nothing."""
    scrubbed = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_")
        and k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "MEGAZPP_RSH")
    }
    return {
        **scrubbed,
        "NETLAB_PREFIX": PREFIX,
        "NETLAB_SUBNET": SUBNET,
        "NETLAB": str(NETLAB),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _netlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(NETLAB), *args], env=_env(), text=True, capture_output=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def nodes():
    with netlab_nodes(_netlab):
        yield


def _on_each_node(env_for_node, args: list[str]) -> list[str]:
    procs = [
        subprocess.Popen(
            ["bash", str(NETLAB), "run", str(n), "bash", "run.sh", *args],
            env=env_for_node(n),
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for n in (0, 1)
    ]
    return finish_all(procs, "node", RUN_TIMEOUT_S)


def _losses(tb: Path) -> list[float]:
    series = read_run(tb, tb.name).scalars["train/loss"]
    assert list(series.steps) == [1, 2, 3]
    return [float(v) for v in series.values]


def _run_args(tmp_path: Path, name: str) -> list[str]:
    return [*FLAGS, "--save", str(tmp_path / f"ckpt_{name}"), "--tensorboard-dir", str(tmp_path / f"tb_{name}")]


@pytest.fixture
def by_hand(nodes, tmp_path, run_sh_data_dir) -> list[float]:
    port = str(random.randrange(20000, 30000))
    _on_each_node(
        lambda n: _env(
            NNODES="2",
            NODE_RANK=str(n),
            MASTER_ADDR=f"{SUBNET}.1",
            MASTER_PORT=port,
            NPROC_PER_NODE="1",
            DATA_DIR=str(run_sh_data_dir),
        ),
        _run_args(tmp_path, "hand"),
    )
    return _losses(tmp_path / "tb_hand")


def test_slurm_job_and_hostfile_launch_match_a_launch_by_hand(by_hand, tmp_path, run_sh_data_dir):
    job_id = random.randrange(100000, 999999)
    slurm = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": f"{PREFIX}-node[0-1]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "DATA_DIR": str(run_sh_data_dir),
    }
    outputs = _on_each_node(lambda n: _env(SLURM_NODEID=str(n), **slurm), _run_args(tmp_path, "slurm"))
    port = 10000 + job_id % 20000
    for n, out in enumerate(outputs):
        assert (
            f"run.sh: from SLURM: NNODES=2 NODE_RANK={n} MASTER_ADDR={HOSTS[0]} MASTER_PORT={port} NPROC_PER_NODE=1"
        ) in out
    assert _losses(tmp_path / "tb_slurm") == by_hand

    rsh = tmp_path / "ssh"
    rsh.write_text(FAKE_SSH)
    rsh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    launcher = subprocess.run(
        ["bash", "tools/launch_hosts.sh", str(hostfile), *_run_args(tmp_path, "hosts")],
        env=_env(MEGAZPP_RSH=str(rsh), DATA_DIR=str(run_sh_data_dir)),
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert launcher.returncode == 0, launcher.stdout[-3000:] + launcher.stderr[-2000:]
    assert f"2 hosts x 1 ranks, master {HOSTS[0]}:" in launcher.stderr
    lines = launcher.stdout.splitlines()
    assert lines and all(line.startswith((f"{HOSTS[0]}: ", f"{HOSTS[1]}: ")) for line in lines)
    assert any(line.startswith(f"{HOSTS[0]}: ") and "iter      3/3" in line for line in lines)
    assert _losses(tmp_path / "tb_hosts") == by_hand
    print(f"losses of all three launches: {by_hand}")


def test_hostfile_launch_stops_every_host_when_one_fails(nodes, tmp_path, run_sh_data_dir):
    """mz23-node1 fails 20 s after its start; mz23-node0 runs the real run.sh, which waits in the
    rendezvous for its peer (up to torchrun's 15 minutes) until the launcher stops it."""
    rsh = tmp_path / "ssh"
    rsh.write_text(FAKE_SSH)
    rsh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    started = time.monotonic()
    launcher = subprocess.run(
        ["bash", "tools/launch_hosts.sh", "--stop-grace", "20", str(hostfile), *_run_args(tmp_path, "fail")],
        env=_env(MEGAZPP_RSH=str(rsh), DATA_DIR=str(run_sh_data_dir), FAIL_HOST=HOSTS[1], FAIL_AFTER_S="20"),
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert launcher.returncode == 1, launcher.stdout[-3000:] + launcher.stderr[-2000:]
    assert f"{HOSTS[1]}: {HOSTS[1]}: simulated failure" in launcher.stdout
    assert f"{HOSTS[1]} (node 1) exited with code 1: stopping the others" in launcher.stderr
    assert time.monotonic() - started < 120
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "ckpt_fail")], capture_output=True, text=True)
    assert left.stdout == "", f"processes of the stopped host are still running: {left.stdout}"
