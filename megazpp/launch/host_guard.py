"""One host's side of `tools/launch_hosts.sh`: run a command so that the launcher can stop it.

Killing the local ssh (or pdsh) client does not stop what it started on the far side: without a
terminal the remote command gets no hangup. So every host runs its command through

    python -m megazpp.launch.host_guard --pidfile FILE -- CMD...   (run CMD in a new process group)
    python -m megazpp.launch.host_guard --stop FILE                (stop that group: TERM, then KILL)

and the launcher stops a host by starting the second form there. The group holds `run.sh`,
torchrun and every rank, so one signal reaches them all. A stop that arrives before the run
has started is not lost: `--stop` leaves a marker that the run checks after publishing its
process group (each side writes its own file before reading the other's).
Standard library only: it runs before `run.sh` installs anything.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STOP_SUFFIX = ".stop"


def exit_code(returncode: int) -> int:
    """A shell's view of a Popen return code: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def run_guarded(command: list[str], pidfile: Path) -> int:
    """Run `command` as the leader of a new process group published in `pidfile`; a TERM, INT or
    HUP to this process is passed to the whole group. Returns the command's exit code."""
    stop_marker = pidfile.with_name(pidfile.name + STOP_SUFFIX)
    child = subprocess.Popen(command, start_new_session=True)
    tmp = pidfile.with_name(pidfile.name + ".tmp")
    tmp.write_text(f"{child.pid}\n")
    tmp.replace(pidfile)

    def forward(signum: int, _frame: object) -> None:
        _signal_group(child.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    if stop_marker.exists():
        _signal_group(child.pid, signal.SIGTERM)
    try:
        return exit_code(child.wait())
    finally:
        pidfile.unlink(missing_ok=True)
        stop_marker.unlink(missing_ok=True)


def stop_guarded(pidfile: Path, grace_s: float) -> None:
    """TERM the published group (the trainer saves and exits), KILL whatever is left after
    `grace_s` seconds; a run not started yet finds the marker and stops itself."""
    pidfile.with_name(pidfile.name + STOP_SUFFIX).touch()
    try:
        pgid = int(pidfile.read_text())
    except FileNotFoundError:
        return
    deadline = time.monotonic() + grace_s
    if not _signal_group(pgid, signal.SIGTERM):
        return
    while time.monotonic() < deadline:
        if not _signal_group(pgid, 0):
            return
        time.sleep(0.2)
    _signal_group(pgid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazpp.launch.host_guard", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--pidfile", type=Path, help="run the command after '--', publishing its process group here")
    mode.add_argument("--stop", type=Path, metavar="PIDFILE", help="stop the run published in PIDFILE")
    parser.add_argument(
        "--grace", type=float, default=60.0, help="seconds between TERM and KILL when stopping (default 60)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.stop is not None:
        stop_guarded(args.stop, args.grace)
        return 0
    if not command:
        parser.error("--pidfile needs a command after '--'")
    return run_guarded(command, args.pidfile)


if __name__ == "__main__":
    sys.exit(main())
