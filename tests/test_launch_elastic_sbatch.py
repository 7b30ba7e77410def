"""The SLURM example of an elastic job, one job per island (tools/slurm/elastic.sh,
island.sbatch, lighthouse.sbatch), with stand-ins for sbatch and srun: what elastic.sh submits,
that an island job starts pretrain.sbatch's run.sh with the lighthouse's address and its id, its
refusal without a lighthouse, and the lighthouse job serving at the address it wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import ROOT, free_port

from tests.test_launch_sbatch import SRUN_RUN_SH, job  # noqa: F401  # job: stand-in srun / scontrol, a submit dir

SLURM = ROOT / "tools" / "slurm"
FAKE_SBATCH = """#!/usr/bin/env bash
n=$(( $(cat "$LOG/sbatch.n" 2>/dev/null || echo 100) + 1 ))
echo "$n" > "$LOG/sbatch.n"
echo "$@" >> "$LOG/sbatch.calls"
echo "$n"
"""


def test_elastic_sh_submits_a_lighthouse_and_one_job_per_island(job, tmp_path):  # noqa: F811
    sbatch = Path(job["PATH"].split(":")[0]) / "sbatch"
    sbatch.write_text(FAKE_SBATCH)
    sbatch.chmod(0o755)
    env = {**job, "JOB_NAME": "tiny", "ELASTIC_DIR": str(tmp_path / "el")}
    run = subprocess.run(
        ["bash", str(SLURM / "elastic.sh"), "2", "2", "--train-iters", "5"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    calls = (Path(job["LOG"]) / "sbatch.calls").read_text().splitlines()
    addr = tmp_path / "el" / "lighthouse.addr"
    assert calls[0] == (
        f"--parsable --job-name=tiny-lighthouse --export=ALL,LIGHTHOUSE_FILE={addr} {SLURM}/lighthouse.sbatch 2"
    )
    for i, call in enumerate(calls[1:]):
        assert call == (
            f"--parsable --job-name=tiny-island{i} --dependency=after:101 --export=ALL,ISLAND_ID={i},"
            f"LIGHTHOUSE_FILE={addr},CKPT_DIR={tmp_path / 'el'}/island{i} {SLURM}/island.sbatch "
            "--outer-min-islands 2 --train-iters 5"
        )
    assert len(calls) == 3
    assert "elastic.sh: island 1: job 103" in run.stdout


def _island(job: dict[str, str], addr: Path) -> subprocess.CompletedProcess:  # noqa: F811
    (Path(job["SLURM_SUBMIT_DIR"]) / "tools").symlink_to(ROOT / "tools")
    env = {**job, "FAKE_SRUN_EXIT": "0", "ISLAND_ID": "3", "LIGHTHOUSE_FILE": str(addr), "LIGHTHOUSE_WAIT_S": "1"}
    return subprocess.run(
        ["bash", str(SLURM / "island.sbatch"), "--train-iters", "5"], env=env, capture_output=True, text=True
    )


def test_an_island_job_runs_run_sh_elastic_at_the_lighthouse(job, tmp_path):  # noqa: F811
    addr = tmp_path / "lighthouse.addr"
    addr.write_text("lh-node:29510\n")
    run = _island(job, addr)
    assert run.returncode == 0, run.stderr
    assert (Path(job["LOG"]) / "srun.args").read_text().split() == [
        *SRUN_RUN_SH,
        "--outer-algorithm",
        "diloco",
        "--outer-elastic",
        "--outer-lighthouse",
        "lh-node:29510",
        "--outer-island-id",
        "3",
        "--train-iters",
        "5",
    ]


def test_an_island_job_without_a_lighthouse_is_refused(job, tmp_path):  # noqa: F811
    run = _island(job, tmp_path / "lighthouse.addr")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "no lighthouse address in" in run.stderr, run.stderr
    assert not (Path(job["LOG"]) / "srun.args").exists()


def test_the_lighthouse_job_serves_at_the_address_it_wrote(tmp_path):
    port, addr = free_port(), tmp_path / "lighthouse.addr"
    env = {
        **os.environ,
        "SLURM_SUBMIT_DIR": str(ROOT),
        "LIGHTHOUSE_FILE": str(addr),
        "LIGHTHOUSE_PORT": str(port),
        "PYTHON": sys.executable,
    }
    proc = subprocess.Popen(
        ["bash", str(SLURM / "lighthouse.sbatch"), "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        out = b""
        while b"lighthouse: listening at " not in out:
            assert proc.poll() is None and time.monotonic() < deadline, out
            out += proc.stdout.readline()  # type: ignore[union-attr]
        host, _, written = addr.read_text().strip().rpartition(":")
        assert written == str(port) and host
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
