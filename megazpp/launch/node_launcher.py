"""One node's launcher: torchrun, with a rendezvous that says what it waits for and fails in
one line.

Why not torchrun alone: with a node that never comes, torchrun waits its join timeout (600 s)
in silence and ends in a bare `RendezvousTimeoutError`; a node whose master is unreachable
gives up after about 90 s with some 200 lines of C++ frames; a second job started on a port
another job's rendezvous holds joins that rendezvous and dies in an `AttributeError`. Here:

- a single-node run without `--master-port` gets a free port;
- node 0 hosts the rendezvous store (stated, not guessed from host names) and first checks
  that its port is free, so a second job on the same port stops at once, naming it;
- another node waits for node 0's address and port to accept connections;
- while waiting (for the address, or for every node to join), a line every
  `--report-interval` seconds (30) says what is awaited and for how long;
- after `--rdzv-timeout` seconds (600) the wait ends with one line naming address and port.

A rank dies with its launcher, even a SIGKILLed one (`lifeline`: its parent-death signal).
SIGTERM and SIGINT are forwarded to this node's ranks, and the launcher keeps waiting for
them: a rank finishes its step, saves and exits 0 (`megazpp.training.stopping`), so the
launcher, and the job, end with 0 too. (torchrun's own handler would end the launcher with an
exception at once and kill the ranks 30 s later, whether or not they had finished saving.)
The other signals keep torchrun's handling.

Everything else is torchrun's own launch, run in this process: `python -m
megazpp.launch.node_launcher --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr
10.0.0.1 --master-port 29500 pretrain_gpt.py ...`.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from megazpp.cli import run_tool
from megazpp.errors import CommunicationError, ConfigError
from megazpp.launch.lifeline import name_launcher
from megazpp.launch.proc_tree import child_pids

if TYPE_CHECKING:  # torch is imported late: the launcher must answer fast on bad input
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

Report = Callable[[float], str]  # seconds waited -> the line saying what is awaited

BACKEND = "megazpp-c10d"
MULTI_NODE_DEFAULT_PORT = 29500  # every node must name the same port: no free-port choice
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_REPORT_S = 30.0


def _say(text: str) -> None:
    """One line on stderr; `os.write`, since signal handlers and a reporter thread call it."""
    os.write(2, f"node_launcher: {text}\n".encode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def resolve_port(given: str, nnodes: int) -> int:
    """The rendezvous port: `given`, else a free one on a single node, else 29500."""
    if not given:
        return free_port() if nnodes == 1 else MULTI_NODE_DEFAULT_PORT
    try:
        port = int(given)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"MASTER_PORT = {given!r}: expected a port number in 1..65535")
    return port


def check_port_free(addr: str, port: int) -> None:
    """Node 0 binds the rendezvous store on every interface; refuse a port already taken
    (a TIME_WAIT leftover is fine, as for the store itself: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise CommunicationError(
                f"rendezvous port {port} (MASTER_PORT) is already in use on this host, by "
                "another job's rendezvous or another program: choose another MASTER_PORT, or "
                "leave it unset on a single node to get a free one"
            ) from None


class _Reporter:
    """A thread that prints `what()` every `interval` seconds until stopped."""

    def __init__(self, what: Report, interval: float) -> None:
        self._what, self._interval = what, interval
        self._done = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Reporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            _say(self._what(time.monotonic() - self._started))


def wait_reachable(addr: str, port: int, timeout: float, interval: float) -> None:
    """Until `timeout`, retry connecting to node 0's rendezvous (it may start after us)."""
    deadline = time.monotonic() + timeout
    last = "no attempt"
    with _Reporter(
        lambda s: (
            f"waiting for node 0's rendezvous at {addr}:{port} to accept "
            f"connections ({s:.0f} s of {timeout:.0f} s; last attempt: {last})"
        ),
        interval,
    ):
        while True:
            left = deadline - time.monotonic()
            try:
                socket.create_connection((addr, port), timeout=max(0.1, min(5.0, left))).close()
                return
            except OSError as exc:
                last = exc.strerror or str(exc) or type(exc).__name__
            if time.monotonic() >= deadline:
                raise CommunicationError(
                    f"cannot reach the rendezvous at {addr}:{port} (MASTER_ADDR:MASTER_PORT) "
                    f"after {timeout:.0f} s: {last}; is node 0 started with the same "
                    "MASTER_PORT, is the address this node can route to, is the port open?"
                )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


class _WatchedRendezvous:
    """torchrun's c10d rendezvous handler, reporting while `next_rendezvous` waits."""

    def __init__(self, inner: RendezvousHandler, what: Report, interval: float) -> None:
        self._inner, self._what, self._interval = inner, what, interval

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        with _Reporter(self._what, self._interval):
            return self._inner.next_rendezvous()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _register_backend(nnodes: int, node_rank: int, addr: str, port: int, timeout: float, interval: float) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    def create(params: RendezvousParameters) -> _WatchedRendezvous:
        if node_rank != 0:
            wait_reachable(addr, port, timeout, interval)
        backend, store = create_backend(params)
        return _WatchedRendezvous(
            create_handler(store, backend, params),
            lambda s: (
                f"rendezvous at {addr}:{port}: waiting for all {nnodes} nodes to join "
                f"(this is node {node_rank}; {s:.0f} s of {timeout:.0f} s)"
            ),
            interval,
        )

    # duck-typed: _WatchedRendezvous forwards every RendezvousHandler method to the handler it wraps
    rendezvous_handler_registry.register(BACKEND, create)  # type: ignore[arg-type]


FORWARDED = (signal.SIGTERM, signal.SIGINT)
# torchrun handles the signals named here; SIGTERM and SIGINT are left to `_forward`.
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


def _child_pids() -> list[int]:
    """This process's children: torchrun starts the ranks directly, each in its own session
    (so a terminal's Ctrl-C reaches only the launcher)."""
    return child_pids(os.getpid())


def _forward(signum: int, _frame: FrameType | None) -> None:
    """Pass SIGTERM / SIGINT on to the ranks and keep waiting for them; before any rank
    exists (waiting for the rendezvous) there is nothing to save: stop."""
    name = signal.Signals(signum).name
    ranks = _child_pids()
    if not ranks:
        _say(f"{name} received before the ranks started: stopping")
        raise SystemExit(128 + signum)
    _say(f"{name} received: forwarded to this node's ranks {ranks}")
    for pid in ranks:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def launch(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    port = resolve_port(args.master_port, args.nnodes)
    if args.node_rank == 0:
        check_port_free(args.master_addr, port)
    _register_backend(args.nnodes, args.node_rank, args.master_addr, port, args.rdzv_timeout, args.report_interval)
    endpoint = f"{args.master_addr}:{port}"
    torchrun_args = [
        "--nnodes",
        str(args.nnodes),  # the node rank matters to node 0 hosting (is_host)
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--max-restarts",
        str(args.max_restarts),
        "--rdzv-backend",
        BACKEND,
        "--rdzv-endpoint",
        endpoint,
        "--signals-to-handle",
        TORCHRUN_SIGNALS,
        "--rdzv-conf",
        f"join_timeout={max(1, round(args.rdzv_timeout))},is_host={'true' if args.node_rank == 0 else 'false'}",
        *args.command,
    ]
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    name_launcher()  # the ranks die with this process, a `kill -9` included (lifeline.py)
    try:
        torchrun.run(torchrun.parse_args(torchrun_args))
    except ChildFailedError as exc:
        print(str(exc), file=sys.stderr, flush=True)  # torchrun's table of failed ranks
        return 1
    except SignalException as exc:  # SIGHUP / SIGQUIT: torchrun stopped the ranks
        return 128 + int(exc.sigval)
    except RendezvousTimeoutError:
        raise CommunicationError(
            f"rendezvous at {endpoint} timed out after {args.rdzv_timeout:.0f} s (RDZV_TIMEOUT): "
            f"not all {args.nnodes} nodes joined; start the same command on every node with "
            f"NNODES={args.nnodes}, NODE_RANK 0..{args.nnodes - 1} and this MASTER_ADDR and "
            "MASTER_PORT"
        ) from None
    except (RendezvousError, dist.DistError) as exc:
        cause = exc.__cause__ or exc
        raise CommunicationError(
            f"rendezvous at {endpoint} failed on node {args.node_rank}: {_one_line(cause)}"
        ) from None
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="node_launcher", description=__doc__.split("\n")[0])
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", default="", help="empty: a free port on a single node, 29500 on several")
    parser.add_argument(
        "--rdzv-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds to wait for node 0 and for every node to join",
    )
    parser.add_argument(
        "--report-interval", type=float, default=DEFAULT_REPORT_S, help="seconds between 'waiting for ...' lines"
    )
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument(
        "--remove-after", help="a file the job made for its ranks (run.sh's checked run), removed when this ends"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = parser.parse_args(list(argv))
    if not args.command:
        parser.error("give the training script to run, e.g. pretrain_gpt.py --config FILE")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"NODE_RANK = {args.node_rank}: expected 0..{args.nnodes - 1} for NNODES = {args.nnodes}")
    if args.rdzv_timeout <= 0 or args.report_interval <= 0:
        raise ConfigError(
            f"RDZV_TIMEOUT = {args.rdzv_timeout} and the report interval {args.report_interval} must be > 0 seconds"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return launch(args)
    finally:
        if args.remove_after:  # every attempt (restarts included) has read it by now
            Path(args.remove_after).unlink(missing_ok=True)


if __name__ == "__main__":
    run_tool(main)
