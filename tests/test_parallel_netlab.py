"""netlab: two real network nodes on one machine (tools/netlab.sh), and the kernel's byte
counters on their inter-node links against the counted-collective reports.

Runs only as root with `ip`, `tc` and `unshare` present; otherwise each test is skipped with
the reason printed (pytest -ra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import finish_all
from support import checkout_env

REPO = Path(__file__).resolve().parents[1]
NETLAB = REPO / "tools" / "netlab.sh"
PREFIX = f"mzt{os.getpid() % 10000}"
SUBNET = f"10.78.{os.getpid() % 250}"
RATE = "1gbit"
RUN_TIMEOUT_S = 420


pytestmark = pytest.mark.netlab  # skipped with the reason where netlab cannot run (conftest)


def _netlab(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "NETLAB_PREFIX": PREFIX, "NETLAB_SUBNET": SUBNET}
    return subprocess.run(
        ["bash", str(NETLAB), *args], env=env, text=True, capture_output=True, timeout=timeout, check=False, **kw
    )


@pytest.fixture
def nodes():
    """Two nodes joined by 1 Gbit/s links; always removed afterwards."""
    _netlab("down")
    up = _netlab("up", "2", RATE, "0")
    assert up.returncode == 0, up.stderr
    try:
        yield f"{SUBNET}.1"
    finally:
        down = _netlab("down")
        assert down.returncode == 0, down.stderr
        assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _rx_bytes() -> int:
    total = 0
    for node in (0, 1):
        out = _netlab("bytes", str(node))
        assert out.returncode == 0, out.stderr
        total += int(out.stdout.split()[0])
    return total


def _on_both_nodes(command_for_node, env: dict[str, str]) -> list[str]:
    """Start the command on both nodes at once (they rendezvous); both outputs once both exit 0."""
    base = checkout_env(NETLAB_PREFIX=PREFIX, NETLAB_SUBNET=SUBNET, PYTHON=sys.executable, **env)
    procs = [
        subprocess.Popen(
            ["bash", str(NETLAB), "run", str(node), *command_for_node(node)],
            env=base,
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    return finish_all(procs, "node", RUN_TIMEOUT_S)


def _torchrun(node: int, master: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        str(node),
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{master}:{port}",
    ]


def test_collective_wire_bytes_per_operation(nodes, tmp_path):
    """Every operation puts the counted bytes on the link (megazpp.parallel.wire's gloo model:
    rings by their cross-node hops, reduce-scatter as gloo's all-reduce), within 2 %: TCP/IP
    framing and ACKs, which the counter does not see (docs/arch/parallel.md)."""
    out = tmp_path / "wire.json"
    port = 29700 + os.getpid() % 200
    _on_both_nodes(
        lambda n: [*_torchrun(n, nodes, port), "-m", "megazpp.parallel.wire_check", "--out", str(out), "--mib", "4"],
        {"OMP_NUM_THREADS": "1"},
    )
    ops = json.loads(out.read_text())["operations"]
    for name, row in sorted(ops.items()):
        print(
            f"{name:15s} counted {row['counted_inter_bytes']:>10d}  kernel {row['kernel_rx_bytes']:>10d}  "
            f"ratio {row['kernel_rx_bytes'] / row['counted_inter_bytes']:.3f}"
        )
    for name in ("all_to_all", "broadcast", "all_gather", "all_reduce", "reduce_scatter"):
        measured = ops[name]["kernel_rx_bytes"] / ops[name]["counted_inter_bytes"]
        assert 1.0 <= measured <= 1.02, (name, measured)


def test_two_node_training_through_run_sh(nodes, tmp_path, run_sh_data_dir):
    """2 nodes x 2 ranks (TP=2 inside each node, DP=2 across): the run completes and the
    kernel's inter-node byte count agrees with the counted reports within 2 % (measured 1.006:
    TCP/IP framing, ACKs and the rendezvous, which no counter sees)."""
    data = run_sh_data_dir
    reports = tmp_path / "reports"
    port = 29900 + os.getpid() % 90
    flags = [
        "--tensor-model-parallel-size",
        "2",
        "--train-iters",
        "6",
        "--lr-warmup-iters",
        "1",
        "--seq-length",
        "64",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--save",
        str(tmp_path / "ckpt"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    before = _rx_bytes()
    runs = _on_both_nodes(
        lambda n: ["env", f"NODE_RANK={n}", "bash", "run.sh", *flags],
        {
            "NNODES": "2",
            "MASTER_ADDR": nodes,
            "MASTER_PORT": str(port),
            "NPROC_PER_NODE": "2",
            "DATA_DIR": str(data),
            "MEGAZPP_COMM_REPORT_DIR": str(reports),
        },
    )
    kernel = _rx_bytes() - before
    per_rank = [json.loads((reports / f"comm_rank{r}.json").read_text()) for r in range(4)]
    counted = sum(r["run"]["inter"] for r in per_rank)
    print(f"inter-node bytes: counted {counted}, kernel (veth rx, both nodes) {kernel}, ratio {kernel / counted:.3f}")
    assert counted > 1_000_000, "the run moved too little across nodes to compare"
    assert counted <= kernel <= 1.02 * counted, (kernel, counted, runs[0][-2000:])
