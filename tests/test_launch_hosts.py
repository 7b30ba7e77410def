"""The hostfile launcher (tools/launch_hosts.sh) without a cluster: every "host" is this machine,
reached through a stand-in for ssh that runs the command line locally, and `run.sh` is a small
script in a stand-in checkout (--workdir) that reports its node variables, fails or waits.
The real run.sh over real network namespaces: tests/test_launch_netlab.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import as_from_a_terminal

from megazpp.errors import LaunchError
from megazpp.launch.hosts import Host, parse_hostfile

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "tools" / "launch_hosts.sh"

# With WAIT=1 a node waits for a signal, writing down that it got it (a stopped host leaves
# "<node>.stopped" behind); node FAIL_NODE fails once node 0 is waiting.
FAKE_RUN_SH = """\
echo "node $NODE_RANK of $NNODES master $MASTER_ADDR:$MASTER_PORT ranks $NPROC_PER_NODE" \
     "env ${MEGAZPP_TEST_FORWARDED:-none} args $*"
trap 'touch "$MARKS/$NODE_RANK.stopped"; exit 143' TERM
if [ "${FAIL_NODE:-}" = "$NODE_RANK" ]; then
  while [ ! -e "$MARKS/0.started" ]; do sleep 0.1; done
  echo "node $NODE_RANK fails"; exit 3
fi
[ "${WAIT:-0}" = 1 ] || exit 0
touch "$MARKS/$NODE_RANK.started"
sleep 300 & wait
"""


@pytest.fixture
def checkout(tmp_path) -> Path:
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "run.sh").write_text(FAKE_RUN_SH)
    (tmp_path / "marks").mkdir()
    (tmp_path / "rsh").write_text('#!/usr/bin/env bash\n# stand-in for "ssh HOST CMDLINE"\nexec bash -c "$2"\n')
    (tmp_path / "rsh").chmod(0o755)
    (tmp_path / "hosts").write_text("# two nodes\nalpha slots=2\n\nbeta slots=2  # second\n")
    return work


def _launch(tmp_path: Path, checkout: Path, **env: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    full.update(
        {
            "PYTHON": sys.executable,
            "PYTHONPATH": str(REPO),
            "MARKS": str(tmp_path / "marks"),
            "MEGAZPP_RSH": str(tmp_path / "rsh"),
            "MEGAZPP_TEST_FORWARDED": "yes",
            **env,
        }
    )
    return subprocess.Popen(
        [
            "bash",
            str(LAUNCHER),
            "--workdir",
            str(checkout),
            "--stop-grace",
            "10",
            str(tmp_path / "hosts"),
            "--train-iters",
            "3",
        ],
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=as_from_a_terminal,  # its SIGINT test: a shell cannot trap a signal ignored at entry
    )


def test_every_host_starts_with_its_node_variables(tmp_path, checkout):
    proc = _launch(tmp_path, checkout)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = sorted(out.splitlines())
    port = re.search(r"master alpha:(\d+)", out).group(1)
    assert lines == [
        f"alpha: node 0 of 2 master alpha:{port} ranks 2 env yes args --train-iters 3",
        f"beta: node 1 of 2 master alpha:{port} ranks 2 env yes args --train-iters 3",
    ]


def test_one_failing_host_stops_the_others(tmp_path, checkout):
    """beta exits 3: alpha (waiting, as a rank in a collective would) gets the TERM its guard
    sends (killing the local client alone would not reach it) and the launcher exits with 3."""
    proc = _launch(tmp_path, checkout, FAIL_NODE="1", WAIT="1")
    out, err = proc.communicate(timeout=60)  # alpha, not stopped, would wait 300 s
    assert proc.returncode == 3, (out, err)
    assert "beta: node 1 fails" in out
    assert "beta (node 1) exited with code 3: stopping the others" in err
    assert (tmp_path / "marks" / "0.stopped").exists()


def test_ctrl_c_stops_every_host(tmp_path, checkout):
    proc = _launch(tmp_path, checkout, WAIT="1")
    marks = tmp_path / "marks"
    deadline = time.monotonic() + 60
    while not ((marks / "0.started").exists() and (marks / "1.started").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, (out, err)
    assert "SIGINT: stopping every host" in err
    assert (marks / "0.stopped").exists() and (marks / "1.stopped").exists()


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed")
def test_pdsh_is_used_when_installed(tmp_path, checkout):
    """pdsh (its ssh module, reaching a stand-in ssh on PATH) carries the same command lines."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ssh").write_text('#!/usr/bin/env bash\nexec bash -c "${@: -1}"\n')
    (fake_bin / "ssh").chmod(0o755)
    proc = _launch(
        tmp_path,
        checkout,
        MEGAZPP_RSH="",
        PDSH_RCMD_TYPE="ssh",
        FAIL_NODE="1",
        WAIT="1",
        PATH=f"{fake_bin}:{os.environ['PATH']}",
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, (out, err)
    assert "via pdsh" in err and "beta: node 1 fails" in out
    assert (tmp_path / "marks" / "0.stopped").exists()


def test_a_missing_remote_shell_is_refused(tmp_path, checkout):
    proc = _launch(tmp_path, checkout, MEGAZPP_RSH=str(tmp_path / "no-such-ssh") + " -x")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    missing = tmp_path / "no-such-ssh"
    assert err == f"launch_hosts: error: MEGAZPP_RSH='{missing} -x': command '{missing}' not found\n"
    proc = _launch(tmp_path, checkout, MASTER_PORT="29x")
    assert proc.communicate(timeout=60)[1] == "launch_hosts: error: MASTER_PORT='29x' is not a port number (1-65535)\n"


def test_a_stop_before_the_run_started_is_not_lost(tmp_path):
    """The launcher may stop a host whose guard has not started yet: the run, once started,
    finds the stop marker and ends at once, leaving no pid file or marker behind."""
    pidfile = tmp_path / "run.pid"
    guard = [sys.executable, "-m", "megazpp.launch.host_guard"]
    stop = subprocess.run([*guard, "--stop", str(pidfile)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    # not stopped, the run would last 600 s, past the timeout; stopped, sleep dies of SIGTERM
    run = subprocess.run([*guard, "--pidfile", str(pidfile), "--", "sleep", "600"], cwd=REPO, timeout=60)
    assert run.returncode == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_hostfile_parsing(tmp_path):
    good = tmp_path / "good"
    good.write_text("n1 slots=8\n# comment\n  n2   slots=8 # trailing\n")
    assert parse_hostfile(good) == [Host("n1", 8), Host("n2", 8)]
    for text, expected in [
        ("n1\n", "line 1: expected 'HOST slots=N'"),
        ("n1 slots=0\n", "line 1: expected 'HOST slots=N' with N > 0"),
        ("n1 slots=two\n", "got 'n1 slots=two'"),
        ("n1 slots=2\nn1 slots=2\n", "line 2: host 'n1' is listed twice"),
        ("n1 slots=2\nn2 slots=4\n", "different slot counts (n1: 2, n2: 4)"),
        ("# nothing\n", "no 'HOST slots=N' line"),
    ]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(LaunchError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            parse_hostfile(bad)
