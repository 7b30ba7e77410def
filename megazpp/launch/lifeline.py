"""Ranks die with their launcher.

Why: torchrun starts every rank in a session of its own, so a `kill -9` of `run.sh`'s
launcher (`node_launcher`, which runs torchrun's agent in its own process) reached no rank, and
a killed launcher forwards nothing: both ranks went on training under pid 1, saving into
`--save`. Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`) has the kernel kill a process
when the thread that started it ends; the agent starts the ranks from the launcher's main
thread, so that is when the launcher process ends, however it ends.

The launcher names itself in the ranks' environment (`MEGAZPP_LAUNCHER_PID`); a rank arms the
signal as its first act, then checks that its parent is still that process, since a launcher
that died before the signal was armed would never trigger it. Without that variable (a rank
started some other way) or off Linux, nothing is done.

SIGKILL, not SIGTERM: a launcher killed outright means the job is over, and a rank blocked
in a collective whose peer already died would never act on SIGTERM. Nothing is lost but the
steps since the last checkpoint: a save is written to a temporary directory and `latest`
moves only once it is complete (`megazpp.checkpoint`), so a rank killed mid-save leaves
`latest` naming the previous complete checkpoint. To stop with a save, send SIGTERM to the
launcher: it forwards it (`node_launcher`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID_ENV = "MEGAZPP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def name_launcher() -> None:
    """In the launcher, before it starts ranks: they inherit this process's environment."""
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())


def die_with_launcher() -> None:
    """In a rank, first: be SIGKILLed when the launcher that started it ends."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != int(launcher):  # it ended before the signal was armed
        os.write(2, f"rank {os.environ.get('RANK', '?')}: its launcher (pid {launcher}) has ended: exiting\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
