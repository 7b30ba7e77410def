"""tools/slurm/pretrain.sbatch's own logic, with stand-ins for srun and scontrol: how it starts
run.sh, that a signal before the time limit (USR1) or a preemption (TERM) stops the ranks and
requeues the job, that a run ending by itself is not requeued, and the refusal without data."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "tools" / "slurm" / "pretrain.sbatch"
# what pretrain.sbatch starts for the job `tiny`, before the flags it was given
SRUN_RUN_SH = ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "run.sh", "--save", "checkpoints/tiny"]
FAKE_SRUN = """#!/usr/bin/env bash
echo "$@" > "$LOG/srun.args"
trap 'echo TERM > "$LOG/srun.term"; kill $!; exit 143' TERM
[ -n "${FAKE_SRUN_EXIT:-}" ] && exit "$FAKE_SRUN_EXIT"
sleep 300 &
touch "$LOG/srun.started"
wait
"""


@pytest.fixture
def job(tmp_path) -> dict[str, str]:
    bin_dir, log, submit = tmp_path / "bin", tmp_path / "log", tmp_path / "submit"
    for d in (bin_dir, log, submit / "data"):
        d.mkdir(parents=True)
    (submit / "data" / "corpus_text_document.idx").write_bytes(b"")
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "$@" >> "$LOG/scontrol.calls"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(log),
        "SLURM_SUBMIT_DIR": str(submit),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "tiny",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }


def _start(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(SBATCH), "--train-iters", "5"], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_stops_the_ranks_and_requeues(job, sig):
    proc = _start(job)
    log = Path(job["LOG"])
    deadline = time.monotonic() + 30
    while not (log / "srun.started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (log / "srun.args").read_text().split() == [*SRUN_RUN_SH, "--train-iters", "5"]
    assert (log / "srun.term").exists()
    assert (log / "scontrol.calls").read_text() == "requeue 4242\n"
    reason = "time limit near" if sig == signal.SIGUSR1 else "preempted"
    assert f"pretrain.sbatch: {reason}: ranks stopped (exit code 143); requeueing job 4242" in out


@pytest.mark.parametrize("code", ["0", "1"])
def test_a_run_that_ends_by_itself_is_not_requeued(job, code):
    proc = _start({**job, "FAKE_SRUN_EXIT": code})
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == int(code), err
    assert not (Path(job["LOG"]) / "scontrol.calls").exists()


def test_missing_data_is_refused(job):
    (Path(job["SLURM_SUBMIT_DIR"]) / "data" / "corpus_text_document.idx").unlink()
    proc = _start(job)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.count("\n") == 1 and "corpus_text_document.idx does not exist: build the data once" in err
    assert not (Path(job["LOG"]) / "srun.args").exists()
