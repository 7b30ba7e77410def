"""The membership service of an elastic two-level job: torchft's lighthouse, in the job's words.

Why a wrapper and not only `torchft_lighthouse`: the same server (torchft's `LighthouseServer`,
the one its own command runs), with the islands' names for its settings, its address said in
one line when it listens, a refusal in one line for a bad value or a port in use, and an exit
on SIGTERM / SIGINT. Islands name it with `--outer-lighthouse HOST:PORT` (docs/arch/elastic.md):

    python -m megazpp.launch.lighthouse --min-islands 2 --port 29510
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading

from megazpp.cli import run_tool
from megazpp.errors import ConfigError, LaunchError

DEFAULT_PORT = 29510  # torchft_lighthouse's own default
REACH_TIMEOUT_S = 10.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megazpp.launch.lighthouse", description=__doc__.splitlines()[0])
    p.add_argument("--min-islands", type=int, required=True, help="the fewest islands an outer sync waits for")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="the port islands reach it on (0: a free one)")
    p.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="an island without a heartbeat this long is dropped from the next quorum",
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="once min-islands ask, how long a sync waits for the other heartbeating islands (the grace window)",
    )
    ns = p.parse_args(argv)
    if ns.min_islands < 1:
        raise ConfigError(f"--min-islands {ns.min_islands}: expected at least 1 island per outer sync")
    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port {ns.port}: expected a TCP port (0 for a free one)")
    for flag in ("heartbeat_timeout_ms", "join_timeout_ms"):
        if getattr(ns, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: expected a positive number of ms")
    return ns


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}): another service holds it"
            ) from None


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """An island's check before any rank starts: something answers at the lighthouse's
    HOST:PORT (`outer.lighthouse`, its form already checked). Without it, the ranks would build
    their model and data first and only then fail in torchft's client, each in its own words."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise LaunchError(
            f"outer.lighthouse = {address}: nothing answers there ({why}): start the job's membership "
            f"service first (python -m megazpp.launch.lighthouse --min-islands N --port {port}) or give the "
            f"address it listens at (--outer-lighthouse HOST:PORT)"
        ) from None


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    if ns.port:
        _check_port_free(ns.host, ns.port)
    from torchft._torchft import LighthouseServer  # torchft's compiled server (a core dependency)

    server = LighthouseServer(
        bind=f"{ns.host}:{ns.port}",
        min_replicas=ns.min_islands,
        join_timeout_ms=ns.join_timeout_ms,
        heartbeat_timeout_ms=ns.heartbeat_timeout_ms,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"lighthouse: listening at {server.address()} for islands (at least {ns.min_islands} per outer sync, "
        f"heartbeat timeout {ns.heartbeat_timeout_ms} ms, join timeout {ns.join_timeout_ms} ms)",
        flush=True,
    )
    stop.wait()
    server.shutdown()
    print("lighthouse: stopped", flush=True)
    return 0


if __name__ == "__main__":
    run_tool(main, prog="python -m megazpp.launch.lighthouse")
