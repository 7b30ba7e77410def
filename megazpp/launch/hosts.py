"""Start `run.sh` on every host of a hostfile from one command: `tools/launch_hosts.sh HOSTFILE
[run.sh args]`.

The hostfile is DeepSpeed's: one `HOST slots=N` per line (N ranks on that host), `#` comments.
The first host is the master. Each host is reached with `ssh HOST CMD` (or `pdsh -S -N -w HOST
CMD` where pdsh is installed, or the command in MEGAZPP_RSH) and runs `run.sh` in the same
directory as here, with NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT / NPROC_PER_NODE set and
the job's own variables (FORWARDED, FORWARDED_PREFIXES) passed on. Every line a host prints is
shown prefixed by its name. When one host fails, or on Ctrl-C, every other host is stopped
(`megazpp.launch.host_guard`) and the launcher exits non-zero: the first failure's code, or 128 +
the signal. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from megazpp.errors import LaunchError
from megazpp.launch.host_guard import exit_code

REPO = Path(__file__).resolve().parents[2]
FORWARDED = (
    "CONFIG",
    "DATA_DIR",
    "VOCAB_SIZE",
    "PYTHON",
    "PYTHONPATH",
    "MAX_RESTARTS",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
FORWARDED_PREFIXES = ("MEGAZPP_", "NCCL_", "GLOO_", "TORCH_")
FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(path: Path) -> list[Host]:
    """`HOST slots=N` lines; refuses unreadable files, bad lines, repeated hosts and unequal
    slot counts (every node runs the same number of ranks: a node is a block of ranks)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise LaunchError(f"hostfile {path}: cannot read it ({exc.strerror})") from None
    hosts: list[Host] = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = words[1].removeprefix("slots=") if len(words) == 2 else ""
        if not (words[1:] and words[1].startswith("slots=") and slots.isdigit() and int(slots) > 0):
            raise LaunchError(
                f"hostfile {path} line {number}: expected 'HOST slots=N' with N > 0, got {line.strip()!r}"
            )
        if any(h.name == words[0] for h in hosts):
            raise LaunchError(f"hostfile {path} line {number}: host {words[0]!r} is listed twice")
        hosts.append(Host(words[0], int(slots)))
    if not hosts:
        raise LaunchError(f"hostfile {path}: no 'HOST slots=N' line")
    if len({h.slots for h in hosts}) > 1:
        counts = ", ".join(f"{h.name}: {h.slots}" for h in hosts)
        raise LaunchError(
            f"hostfile {path}: hosts have different slot counts ({counts}); megazpp runs the "
            f"same number of ranks on every node"
        )
    return hosts


def remote_shell() -> list[str]:
    """The command that runs a shell command line on a host, given `HOST CMDLINE`."""
    if os.environ.get("MEGAZPP_RSH"):
        rsh = shlex.split(os.environ["MEGAZPP_RSH"])
        if shutil.which(rsh[0]) is None:
            raise LaunchError(f"MEGAZPP_RSH={os.environ['MEGAZPP_RSH']!r}: command {rsh[0]!r} not found")
        return rsh
    if shutil.which("pdsh"):
        return ["pdsh", "-S", "-N", "-w"]
    if shutil.which("ssh"):
        return ["ssh", "-o", "BatchMode=yes"]
    raise LaunchError(
        "neither pdsh nor ssh is installed: set MEGAZPP_RSH to a command that runs 'HOST CMDLINE' on a host"
    )


def forwarded_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}


@dataclass
class Launch:
    """One job: the hosts, where they rendezvous, and how to reach them."""

    hosts: list[Host]
    rsh: list[str]
    workdir: str
    master_addr: str
    master_port: int
    env: dict[str, str]
    python: str
    launch_id: str
    stop_grace_s: float

    def pidfile(self, node_rank: int) -> str:
        return f"/tmp/megazpp-launch-{self.launch_id}-node{node_rank}.pid"

    def run_line(self, node_rank: int, run_args: list[str]) -> str:
        node_env = {
            **self.env,
            "NNODES": str(len(self.hosts)),
            "NODE_RANK": str(node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NPROC_PER_NODE": str(self.hosts[node_rank].slots),
        }
        assignments = [f"{k}={v}" for k, v in node_env.items()]
        command = [
            "env",
            *assignments,
            self.python,
            "-m",
            "megazpp.launch.host_guard",
            "--pidfile",
            self.pidfile(node_rank),
            "--",
            "bash",
            "run.sh",
            *run_args,
        ]
        return f"cd {shlex.quote(self.workdir)} && exec {shlex.join(command)}"

    def stop_line(self, node_rank: int) -> str:
        command = [
            self.python,
            "-m",
            "megazpp.launch.host_guard",
            "--stop",
            self.pidfile(node_rank),
            "--grace",
            str(self.stop_grace_s),
        ]
        return f"cd {shlex.quote(self.workdir)} && exec {shlex.join(command)}"

    def on_host(self, node_rank: int, line: str, *, stdout: int, stderr: int) -> subprocess.Popen[bytes]:
        # A session of its own: Ctrl-C in the terminal reaches the launcher, which stops the
        # hosts in order, instead of killing every ssh client at once.
        return subprocess.Popen(
            [*self.rsh, self.hosts[node_rank].name, line],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
        )


def _stream(name: str, source: BinaryIO, lock: threading.Lock) -> None:
    prefix = f"{name}: ".encode()
    for raw in iter(source.readline, b""):
        with lock:
            sys.stdout.buffer.write(prefix + raw if raw.endswith(b"\n") else prefix + raw + b"\n")
            sys.stdout.buffer.flush()


def _note(message: str) -> None:
    print(f"launch_hosts: {message}", file=sys.stderr, flush=True)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise _Interrupted(signum)


def stop_hosts(launch: Launch, running: dict[int, subprocess.Popen[bytes]]) -> None:
    """Stop every still-running host through its guard, then end the local clients."""
    stoppers = [
        launch.on_host(r, launch.stop_line(r), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r, proc in running.items()
        if proc.poll() is None
    ]
    deadline = time.monotonic() + launch.stop_grace_s + 30
    for proc in [*stoppers, *running.values()]:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_launch(launch: Launch, run_args: list[str]) -> int:
    lock = threading.Lock()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    readers: list[threading.Thread] = []
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank, host in enumerate(launch.hosts):
            proc = launch.on_host(
                rank, launch.run_line(rank, run_args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            procs[rank] = proc
            reader = threading.Thread(target=_stream, args=(host.name, proc.stdout, lock), daemon=True)
            reader.start()
            readers.append(reader)
        while True:
            codes = {r: p.poll() for r, p in procs.items()}
            failed = [(r, c) for r, c in codes.items() if c is not None and c != 0]
            if failed:
                rank, code = failed[0]
                _note(f"{launch.hosts[rank].name} (node {rank}) exited with code {code}: stopping the others")
                stop_hosts(launch, procs)
                return exit_code(code)
            if all(c == 0 for c in codes.values()):
                return 0
            time.sleep(0.2)
    except _Interrupted as interrupt:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not abandon the stop
        _note(f"{signal.Signals(interrupt.signum).name}: stopping every host")
        stop_hosts(launch, procs)
        return 128 + interrupt.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for reader in readers:
            reader.join(timeout=5)


def master_port(value: str | None) -> int | None:
    """MASTER_PORT as given, checked; None when unset."""
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise LaunchError(f"MASTER_PORT={value!r} is not a port number (1-65535)")
    return int(value)


def free_port(rsh: list[str], host: str, python: str) -> int:
    """A port nobody listens on at the master, asked of the master itself."""
    out = subprocess.run(
        [*rsh, host, shlex.join([python, "-c", FREE_PORT])],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )
    words = out.stdout.split()
    if out.returncode != 0 or not words or not words[-1].isdigit():
        raise LaunchError(
            f"cannot reach the master host {host} ({shlex.join(rsh)}): "
            f"{(out.stderr or out.stdout).strip()[-300:] or f'exit code {out.returncode}'}"
        )
    return int(words[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/launch_hosts.sh",
        allow_abbrev=False,
        description="Start run.sh on every host of a hostfile ('HOST slots=N' lines).",
        epilog="Environment: MASTER_ADDR / MASTER_PORT override the first host and a free port on it; "
        f"MEGAZPP_RSH replaces ssh/pdsh; {', '.join(FORWARDED)} and every variable starting with "
        f"{', '.join(FORWARDED_PREFIXES)} are passed on to the hosts.",
    )
    parser.add_argument(
        "--workdir",
        default=str(REPO),
        help="the checkout on the hosts (default: this one's path, the same on every host)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=60.0,
        help="seconds a stopped host gets to save and exit before it is killed (default 60)",
    )
    parser.add_argument("hostfile", type=Path)
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="passed to run.sh on every host")
    args = parser.parse_args(argv)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    try:
        hosts = parse_hostfile(args.hostfile)
        rsh = remote_shell()
        python = os.environ.get("PYTHON", "python3")
        master = os.environ.get("MASTER_ADDR") or hosts[0].name
        port = master_port(os.environ.get("MASTER_PORT")) or free_port(rsh, hosts[0].name, python)
    except LaunchError as exc:
        print(f"launch_hosts: error: {exc}", file=sys.stderr)
        return 2
    launch = Launch(
        hosts,
        rsh,
        args.workdir,
        master,
        port,
        forwarded_env(dict(os.environ)),
        python,
        uuid.uuid4().hex[:12],
        args.stop_grace,
    )
    _note(f"{len(hosts)} hosts x {hosts[0].slots} ranks, master {master}:{port}, via {rsh[0]}")
    return run_launch(launch, run_args)


if __name__ == "__main__":
    sys.exit(main())
