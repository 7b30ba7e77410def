"""One writer per save directory: a lock file in `--save` naming the job that writes there.

Why: two jobs on one `--save` interleave their checkpoints; the second used to die at its
first save with a misleading "No such file or directory" (the first had renamed the
directory it was writing into), after its steps were computed. The lock is held by the job,
not by each rank: global rank 0 (node 0 of a multi-node job, whose `--save` is shared
storage) takes it before step 1 and removes it at exit; `run.sh`'s once-per-job check
(`startup.main` on node 0) refuses a live holder before any rank starts.

The file names the holder's host, pid, process start time (clock ticks since boot, from
/proc/PID/stat) and boot id, so a lock left by a dead job is told from a live one on the same
host: the pid is gone, or it now belongs to another process (another start time), or the host
rebooted (another boot id). Such a lock is taken over, saying so. A holder on another host
cannot be checked from here: the refusal says so and how to remove the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from megazpp.errors import CheckpointError
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology

log = logging.getLogger(__name__)

LOCK_FILE = "writer.lock"


@dataclass(frozen=True)
class Holder:
    """The process that holds a save directory's lock."""

    host: str
    pid: int
    start_ticks: int | None  # /proc/PID/stat field 22; None where there is no /proc
    boot_id: str | None
    since: str  # when it took the lock, UTC, for people

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} (since {self.since})"


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (ticks since boot), None when there is no such process
    or no /proc to ask."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # field 2 (the command) may hold spaces and parentheses: count from its closing one
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def this_process() -> Holder:
    return Holder(
        socket.gethostname(),
        os.getpid(),
        _start_ticks(os.getpid()),
        _boot_id(),
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )


def read_holder(lock: Path) -> Holder | None:
    """The holder a lock file names; None when there is no lock. A file that names none (a
    crash while writing it) is treated as a lock of nobody: stale."""
    try:
        data = json.loads(lock.read_text())
        return Holder(
            str(data["host"]),
            int(data["pid"]),
            data.get("start_ticks"),
            data.get("boot_id"),
            str(data.get("since", "?")),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return Holder("?", 0, None, None, "?")


def why_stale(holder: Holder) -> str | None:
    """Why the lock of `holder`, a process of this host, is left over from a dead job; None
    when the holder is alive."""
    if holder.pid == 0:
        return "the lock file names no holder"
    if holder.boot_id is not None and holder.boot_id != _boot_id():
        return "this host rebooted since"
    now = _start_ticks(holder.pid)
    if now is None:
        if Path("/proc/self/stat").exists():
            return f"pid {holder.pid} is no longer running"
        try:  # no /proc: alive when signal 0 reaches it
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return f"pid {holder.pid} is no longer running"
        except PermissionError:
            pass
        return None
    if holder.start_ticks is not None and now != holder.start_ticks:
        return f"pid {holder.pid} is now another process (another start time)"
    return None


def _is_me(holder: Holder) -> bool:
    return (holder.host, holder.pid) == (socket.gethostname(), os.getpid())


def check_save_lock(save_dir: str) -> None:
    """Refuse a `--save` that a live job holds, or a job on another host (whose liveness
    cannot be checked from here); silent when free or stale (the job's rank 0 takes a stale
    lock over and says so)."""
    lock = Path(save_dir) / LOCK_FILE
    holder = read_holder(lock)
    if holder is None or holder.pid == 0 or _is_me(holder):
        return
    if holder.host != socket.gethostname():
        raise CheckpointError(
            f"--save {save_dir} is locked by {holder.describe()} ({lock}): a job on another "
            f"host cannot be checked from {socket.gethostname()}; if that job is no longer "
            f"running, remove the lock (rm {lock}) and start again"
        )
    if why_stale(holder) is None:
        raise CheckpointError(
            f"--save {save_dir} is in use by another job: {lock} is held by "
            f"{holder.describe()}, which is running; one job writes a save directory at a time: "
            "wait for it, stop it, or give another --save"
        )


def _write_new(lock: Path, me: Holder) -> bool:
    """Create the lock file naming `me`; False when it exists already."""
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(me)) + "\n")
    return True


def acquire(save_dir: str) -> Path:
    """Take `save_dir`'s lock for this process (taking over a stale one, with a warning);
    CheckpointError naming the holder when a live job (or one on another host) has it."""
    lock = Path(save_dir) / LOCK_FILE
    me = this_process()
    if _write_new(lock, me):
        return lock
    check_save_lock(save_dir)
    holder = read_holder(lock)
    if holder is not None and not _is_me(holder):
        log.warning("--save %s: taking over the lock of %s: %s", save_dir, holder.describe(), why_stale(holder))
    tmp = lock.with_name(f"{LOCK_FILE}.{me.pid}")
    tmp.write_text(json.dumps(asdict(me)) + "\n")
    os.replace(tmp, lock)
    if read_holder(lock) != me:  # another job took the stale lock over at the same moment
        check_save_lock(save_dir)
    return lock


def release(lock: Path) -> None:
    """Remove the lock if it still names this process."""
    holder = read_holder(lock)
    if holder is not None and _is_me(holder):
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def hold_save_dir(save_dir: str | None, topology: Topology) -> Iterator[None]:
    """Collective: global rank 0 holds `save_dir`'s lock for the block; a refusal is every
    rank's error (the verdict is exchanged, so no rank trains alone)."""
    if not save_dir:
        yield
        return
    lock, failure = None, ""
    if topology.rank == 0:
        try:
            lock = acquire(save_dir)
        except CheckpointError as exc:
            failure = str(exc)
    failures = sorted({f for f in comm.all_gather_object(failure, tag="checkpoint/lock") if f})
    if failures:
        raise CheckpointError("; ".join(failures))
    try:
        yield
    finally:
        if lock is not None:
            release(lock)
