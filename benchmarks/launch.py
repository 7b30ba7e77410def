"""Start one configuration as 2 nodes x R ranks, on netlab or on the plain loopback.

Why two launchers even on loopback: each node is its own `torch.distributed.run` (c10d
rendezvous, LOCAL_WORLD_SIZE = ranks per node), exactly as on netlab and on a real cluster,
so the only thing that changes between link settings is the link.

netlab runs under its own prefix and subnet (`NETLAB_PREFIX`, `NETLAB_SUBNET`; `mzbench` /
`10.78.0` unless the environment names others, so two benchmarks on one machine can run
apart), so the benchmark never touches a netlab somebody else (a test) has up.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

NETLAB = "tools/netlab.sh"
NETLAB_ENV = {
    "NETLAB_PREFIX": os.environ.get("NETLAB_PREFIX", "mzbench"),
    "NETLAB_SUBNET": os.environ.get("NETLAB_SUBNET", "10.78.0"),
}
LOOPBACK = "loopback"
# Every CPU rank of every runner (megazpp and DeepSpeed alike) starts with these, as run.sh
# starts its CPU ranks: one intra-op thread per rank (4 ranks share 2 cores), and glibc's
# malloc serving large blocks from its heap and keeping freed ones, instead of mapping fresh
# pages for every gathered bucket and paying a page fault per 4 KiB on first touch (measured:
# a 100 MB copy 51 ms with fresh pages, 9 ms reusing them).
CPU_RANK_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """A benchmark's own arguments and those after `--`, which go to every run."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


@dataclass(frozen=True)
class Layout:
    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def _netlab(*args: str, capture: bool = False) -> str:
    env = {**os.environ, **NETLAB_ENV}
    done = subprocess.run(
        ["bash", NETLAB, *args], env=env, check=True, text=True, stdout=subprocess.PIPE if capture else None
    )
    return done.stdout if capture else ""


def netlab_up(nodes: int, rate: str, delay: str) -> None:
    _netlab("down")  # a previous benchmark killed hard may have left ours up
    _netlab("up", str(nodes), rate, delay)


def netlab_down() -> None:
    _netlab("down")


def netlab_rx_bytes(nodes: int) -> int:
    """Bytes received so far by every node's inter-node link (what crossed the slow links)."""
    return sum(int(_netlab("bytes", str(n), capture=True).split()[0]) for n in range(nodes))


def node_addr(setting: str, node: int) -> str:
    if setting == LOOPBACK:
        return "127.0.0.1"
    return _netlab("addr", str(node), capture=True).strip()


def master_addr(setting: str) -> str:
    return node_addr(setting, 0)


def node_command(
    setting: str,
    node: int,
    layout: Layout,
    port: int,
    python: str,
    probe_dir: str,
    script: str,
    args: Sequence[str],
    env: dict[str, str],
) -> list[str]:
    """The command that starts node `node`'s ranks (inside its namespace on netlab)."""
    launch = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(layout.nodes),
        "--node-rank",
        str(node),
        "--nproc-per-node",
        str(layout.ranks_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{master_addr(setting)}:{port}",
        "-m",
        "benchmarks.rank_probe",
        "--out",
        probe_dir,
        script,
        *args,
    ]
    return _on_node(setting, node, env, launch)


def replica_group_ports(nodes: int) -> int:
    """Ports from the run's first that `replica_group_command` uses: lighthouse, loss store,
    one rendezvous per node."""
    return 2 + nodes


def replica_group_command(
    setting: str,
    node: int,
    layout: Layout,
    port: int,
    python: str,
    probe_dir: str,
    script: str,
    args: Sequence[str],
    env: dict[str, str],
) -> list[str]:
    """The command that starts node `node` as its own replica group (torchft's layout): a
    one-node launcher over the node's ranks, rendezvous on the node's address at `port + 2 +
    node` (distinct on the loopback). Group 0's first rank starts the lighthouse at node 0's
    address and `port` and the loss group's store at `port + 1`. Each group advertises its
    node's address (its launcher's store calls itself "localhost", on netlab every node's own).
    The rank probe numbers ranks over all groups (MEGAZPP_PROBE_RANK_BASE), so their files do
    not collide."""
    master = master_addr(setting)
    launch = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(layout.ranks_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{node_addr(setting, node)}:{port + 2 + node}",
        "-m",
        "benchmarks.rank_probe",
        "--out",
        probe_dir,
        script,
        "--replica-group",
        str(node),
        "--replica-groups",
        str(layout.nodes),
        "--lighthouse",
        f"{master}:{port}",
        "--loss-store",
        f"{master}:{port + 1}",
        "--advertise",
        node_addr(setting, node),
        *args,
    ]
    return _on_node(setting, node, {**env, "MEGAZPP_PROBE_RANK_BASE": str(node * layout.ranks_per_node)}, launch)


def _on_node(setting: str, node: int, env: dict[str, str], launch: list[str]) -> list[str]:
    """`launch` with `env`, inside node `node`'s namespace on netlab."""
    with_env = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *launch]
    if setting == LOOPBACK:
        return with_env
    return ["bash", NETLAB, "run", str(node), *with_env]


def run_nodes(commands: Sequence[list[str]], log_paths: Sequence[str], timeout_s: float) -> str | None:
    """Run every node's command at once; None on success, else the reason (exit status or
    timeout, with the last line of the first failing node's log). On a timeout or a failure
    the other nodes are stopped (their whole process groups, which this call created)."""
    procs = []
    for cmd, log in zip(commands, log_paths):
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **NETLAB_ENV}, start_new_session=True
                )
            )
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        while any(p.poll() is None for p in procs):
            failure = _failed_node(procs, log_paths)
            if failure is not None:
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s"
                break
            time.sleep(0.5)
    finally:  # also on Ctrl-C / SIGTERM of the benchmark: no rank outlives it
        _stop(procs)
    return failure or _failed_node(procs, log_paths)


def _failed_node(procs: Sequence[subprocess.Popen[bytes]], log_paths: Sequence[str]) -> str | None:
    bad = next((i for i, p in enumerate(procs) if p.returncode not in (None, 0)), None)
    if bad is None:
        return None
    return f"node {bad} exited with status {procs[bad].returncode}: {_last_line(log_paths[bad])}"


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each still-running node's process group (torchrun passes it to its ranks),
    SIGKILL what is left after 30 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


_ERROR_LINE = re.compile(r"(\w+(Error|Exception): .+|error: .+)")


def _last_line(path: str) -> str:
    """The most telling line of a failed node's log: the last exception or error message a
    rank printed (not the launcher's ChildFailedError wrapper), else the last line."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and "ChildFailedError" not in line:
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"
