"""Launcher hangs, tried as a user would through `run.sh` (short `RDZV_TIMEOUT`s so each takes
seconds): a second node that never comes, a master that cannot be reached, two jobs on one
port, and the default port of a single-node run. Each wait says what it waits for, and each
failure is one line naming the address and port."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
from support import ROOT, TINY_MODEL_FLAGS, checkout_env, free_port
from test_reliability_signals import Run, run_sh_data

TINY = [
    *TINY_MODEL_FLAGS,
    "--global-batch-size",
    "4",
    "--lr-warmup-iters",
    "1",
    "--eval-iters",
    "0",
    "--split",
    "90,10,0",
]


def environment(data_dir, **variables: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in checkout_env().items()
        if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_TIMEOUT")
    }
    env.update({"DATA_DIR": str(data_dir), "PYTHON": sys.executable, "NPROC_PER_NODE": "1", **variables})
    return env


def outputs(data_dir) -> list[str]:
    """Logs and checkpoints next to the test's data, not the YAML's paths in the checkout."""
    return ["--tensorboard-dir", str(data_dir.parent / "tb"), "--save", str(data_dir.parent / "ckpt")]


def run_sh(data_dir, *args: str, timeout: float = 240, **variables: str):
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "run.sh"), *TINY, *outputs(data_dir), *args],
        cwd=ROOT,
        env=environment(data_dir, **variables),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - started


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("node_launcher.py: error: "), proc.stderr
    return errors[0]


@pytest.mark.slow
def test_a_node_that_never_comes_and_an_unreachable_master(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    data = run_sh_data(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model)
    port = free_port()
    # NNODES=2 and node 1 never starts: 614 s of silence, then a bare RendezvousTimeoutError
    proc, took = run_sh(data, NNODES="2", NODE_RANK="0", MASTER_PORT=str(port), RDZV_TIMEOUT="3")
    assert one_error_line(proc) == (
        f"node_launcher.py: error: rendezvous at 127.0.0.1:{port} timed out after 3 s "
        "(RDZV_TIMEOUT): not all 2 nodes joined; start the same command on every node with "
        "NNODES=2, NODE_RANK 0..1 and this MASTER_ADDR and MASTER_PORT"
    )
    assert took < 120  # 3 s of waiting plus start-up on a loaded machine, not 600 s
    # node 1 with nobody listening at the master's port: 89 s and 210 lines of C++ frames
    proc, took = run_sh(data, NNODES="2", NODE_RANK="1", MASTER_PORT=str(port), RDZV_TIMEOUT="3")
    assert one_error_line(proc) == (
        f"node_launcher.py: error: cannot reach the rendezvous at 127.0.0.1:{port} "
        "(MASTER_ADDR:MASTER_PORT) after 3 s: Connection refused; is node 0 started with the "
        "same MASTER_PORT, is the address this node can route to, is the port open?"
    )
    assert len(proc.stderr.strip().splitlines()) == 1 and took < 120


@pytest.mark.slow
def test_waiting_is_reported_while_it_lasts():
    def launcher(node_rank: int, port: int) -> list[str]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megazpp.launch.node_launcher",
                "--nnodes",
                "2",
                "--node-rank",
                str(node_rank),
                "--master-port",
                str(port),
                "--rdzv-timeout",
                "3",
                "--report-interval",
                "1",
                "pretrain_gpt.py",
            ],
            cwd=ROOT,
            env=environment(ROOT),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        return [line for line in proc.stderr.splitlines() if line.startswith("node_launcher: ")]

    port = free_port()
    waiting = launcher(0, port)
    assert len(waiting) >= 2, waiting
    assert waiting[0] == (
        f"node_launcher: rendezvous at 127.0.0.1:{port}: waiting for all 2 nodes to join (this is node 0; 1 s of 3 s)"
    )
    waiting = launcher(1, port)
    assert len(waiting) >= 2, waiting
    assert waiting[0] == (
        f"node_launcher: waiting for node 0's rendezvous at 127.0.0.1:{port} "
        "to accept connections (1 s of 3 s; last attempt: Connection refused)"
    )


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_two_jobs_on_one_port_and_the_free_default_port(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    data = run_sh_data(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model)
    port = free_port()
    first = Run(
        # waits for its peer, which never comes, until the SIGTERM below (the hour is no race
        # with the test: it is longer than any test takes, however loaded the machine)
        ["bash", str(ROOT / "run.sh"), *TINY, *outputs(data)],
        env_extra=environment(data, NNODES="2", NODE_RANK="0", MASTER_PORT=str(port), RDZV_TIMEOUT="3600"),
    )
    try:
        deadline = time.monotonic() + 90
        while not listening(port):
            assert time.monotonic() < deadline and first.proc.poll() is None, first.finish()
            time.sleep(0.5)
        # the second job waited silently, then died with AttributeError ... is_failed
        proc, took = run_sh(data, MASTER_PORT=str(port), RDZV_TIMEOUT="3")
        assert one_error_line(proc) == (
            f"node_launcher.py: error: rendezvous port {port} (MASTER_PORT) is already in use on "
            "this host, by another job's rendezvous or another program: choose another "
            "MASTER_PORT, or leave it unset on a single node to get a free one"
        )
    finally:
        first.proc.send_signal(signal.SIGTERM)
        code, output = first.finish()
    assert code == 128 + signal.SIGTERM and (
        "node_launcher: SIGTERM received before the ranks started: stopping" in output
    ), output

    # without MASTER_PORT a single-node job takes a free port, so 29500 in use is no obstacle
    with socket.socket() as busy:
        try:
            busy.bind(("", 29500))
            busy.listen()
        except OSError:
            pass  # already taken by something else: the same situation
        proc, _ = run_sh(data, "--train-iters", "2", "--log-interval", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "iter      2/2" in proc.stdout


def test_a_bad_port_or_node_rank_is_one_line():
    from megazpp.errors import ConfigError
    from megazpp.launch.node_launcher import parse_args, resolve_port

    for bad in ("abc", "0", "70000"):
        with pytest.raises(ConfigError, match=f"MASTER_PORT = '{bad}': expected a port number in 1..65535"):
            resolve_port(bad, 1)
    assert resolve_port("", 2) == 29500 and resolve_port("1234", 1) == 1234
    with pytest.raises(ConfigError, match="NODE_RANK = 2: expected 0..1 for NNODES = 2"):
        parse_args(["--nnodes", "2", "--node-rank", "2", "pretrain_gpt.py"])
