"""SLURM's node variables for run.sh (megazpp/launch/slurm.py) from faked job environments:
the node-list parser, the derived variables, explicit variables winning, and the refusals.
The same path end to end on two network namespaces: tests/test_launch_netlab.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazpp.errors import LaunchError
from megazpp.launch.slurm import expand_nodelist, job_hosts, slurm_node_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),
        ("login,n[1-2]-ib,x[3]", ["login", "n1-ib", "n2-ib", "x3"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("n[1-2],m[5,7-8]", ["n1", "n2", "m5", "m7", "m8"]),
    ],
)
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, message",
    [
        ("", "node list is empty"),
        ("n[1-2", "'\\[' is never closed"),
        ("n1-2]", "'\\]' without '\\['"),
        ("n[1[2]]", "nested"),
        ("n[4-2]", "range '4-2' runs backwards"),
        ("n[a-b]", "holds 'a-b', expected N or N-M"),
        ("n[1,,2]", "holds '', expected"),
        ("n1,,n2", "empty host name"),
    ],
)
def test_nodelist_refusals(nodelist, message):
    with pytest.raises(LaunchError, match=message):
        expand_nodelist(nodelist)


def _job(**extra: str) -> dict[str, str]:
    """Node 1 of a 4-node job step started with srun --ntasks-per-node=1, 8 GPUs per node."""
    return {
        "SLURM_JOB_ID": "123456",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-09],gpu12",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_NTASKS_PER_NODE": "1",
        "PATH": "/nonexistent",
        **extra,
    }


def test_node_variables_from_the_job():
    assert slurm_node_env(_job()) == {
        "NNODES": "4",
        "NODE_RANK": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(10000 + 123456 % 20000),
        "NPROC_PER_NODE": "8",
    }
    cpu = _job(SLURM_GPUS_ON_NODE="0", SLURM_NTASKS_PER_NODE="2")
    assert slurm_node_env(cpu)["NPROC_PER_NODE"] == "2"
    assert "NPROC_PER_NODE" not in slurm_node_env({k: v for k, v in cpu.items() if "PER_NODE" not in k})
    assert slurm_node_env({"PATH": "/usr/bin"}) == {}
    login_shell = {k: v for k, v in _job().items() if k != "SLURM_NODEID"}  # salloc, not on a node
    assert slurm_node_env(login_shell) == {}
    with pytest.raises(LaunchError, match="SLURM_NNODES is not"):
        slurm_node_env({k: v for k, v in _job().items() if k != "SLURM_NNODES"})


def test_explicit_variables_win():
    explicit = _job(MASTER_ADDR="10.0.0.9", MASTER_PORT="29123", NPROC_PER_NODE="4")
    assert slurm_node_env(explicit) == {"NNODES": "4", "NODE_RANK": "1"}
    # NNODES and NODE_RANK by hand: the job's layout is not used, so no step check either
    assert slurm_node_env(_job(NNODES="1", NODE_RANK="0", SLURM_STEP_NUM_TASKS="32"))["MASTER_ADDR"] == "gpu07"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_STEP_NUM_TASKS": "32"}, "starts 32 tasks on 4 nodes.*srun --ntasks-per-node=1"),
        ({"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"}, "runs on 1 of the job's 4 nodes"),
        ({"SLURM_JOB_NODELIST": "gpu[07-09]"}, "names 3 hosts but SLURM_NNODES=4"),
        ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is not below SLURM_NNODES=4"),
        ({"SLURM_NNODES": "four"}, "SLURM_NNODES='four' is not a whole number"),
        ({"SLURM_NNODES": ""}, "SLURM_NNODES='' is not a whole number"),
    ],
)
def test_refusals(change, message):
    with pytest.raises(LaunchError, match=message):
        slurm_node_env(_job(**change))


def test_batch_script_of_a_multinode_job_is_refused():
    batch = {k: v for k, v in _job().items() if not k.startswith("SLURM_STEP_")}
    with pytest.raises(LaunchError, match="batch script of a 4-node SLURM job.*srun --ntasks-per-node=1"):
        slurm_node_env(batch)
    assert (
        slurm_node_env({**batch, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu07"})["NNODES"]
        == "1"
    )


def test_scontrol_expands_the_list_where_installed(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "first\\nsecond\\n"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    code = "from megazpp.launch.slurm import job_hosts; print(job_hosts('whatever[1-2]'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "['first', 'second']", out.stderr
    assert job_hosts("n[1-2]") == ["n1", "n2"]


def test_run_sh_reads_the_exports():
    """What run.sh evaluates: export lines a shell accepts, and a refusal as one line, exit 2."""
    env = {**_job(), "PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}
    shell = subprocess.run(
        [
            "bash",
            "-c",
            f'eval "$({sys.executable} -m megazpp.launch.slurm)"; '
            'echo "$NNODES $NODE_RANK $MASTER_ADDR $MASTER_PORT $NPROC_PER_NODE"',
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert shell.stdout.split() == ["4", "1", "gpu07", str(10000 + 123456 % 20000), "8"]
    assert "run.sh: from SLURM: NNODES=4 NODE_RANK=1" in shell.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "megazpp.launch.slurm"],
        capture_output=True,
        text=True,
        env={**env, "SLURM_STEP_NUM_TASKS": "32"},
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("run.sh: error: the srun step starts 32 tasks")
