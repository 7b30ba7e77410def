"""Writing a checkpoint, so that a crash never damages the last good one.

Why this order of writes: every rank writes its file into `iter_N.tmp/` (each file itself
via a temporary name and a rename), all ranks meet, rank 0 adds `metadata.json`, renames the
directory to `iter_N`, and only then replaces `latest` (again via a temporary name). A crash
at any point leaves `latest` naming the previous checkpoint, which no step touched. A failed
write (a full disk) on any rank removes the unfinished directory on every rank's word, so
`latest` and the disk are as they were before the save. With `keep_last` N, older checkpoints
are removed only after `latest` names the new one, so a crash mid-removal still leaves the new
one and at worst an old one half removed (never the one `latest` names, which a resume reads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from megazpp import faults
from megazpp.checkpoint.files import fsync_dir, write_atomically
from megazpp.checkpoint.format import (
    CHECKSUMS_KEY,
    FORMAT_VERSION,
    ITER_DIR,
    LATEST_FILE,
    METADATA_FILE,
    checkpoint_name,
    checkpoints_below,
    layout_of,
    rank_file_name,
)
from megazpp.errors import CheckpointError
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.state import StateDict
from megazpp.unique_keys import JSONObject

log = logging.getLogger(__name__)


def _barrier() -> None:
    comm.barrier(tag="checkpoint")


def save_checkpoint(
    save_dir: str | os.PathLike[str],
    iteration: int,
    state: StateDict,
    topology: Topology,
    extra_metadata: JSONObject | None = None,
    keep_last: int | None = None,
) -> Path:
    """Collectively save this rank's `state` as checkpoint `iteration`; return its directory.

    Each rank file is stamped with the layout it was written under, so a loader can tell a
    stray file of another run from this checkpoint's. `extra_metadata` (e.g. the model
    config) goes into `metadata.json`. `keep_last` N: then only the N newest checkpoints up to
    this one stay (`checkpoint.keep_last`).
    """
    root = Path(save_dir)
    name = checkpoint_name(iteration)
    final, tmp = root / name, root / f"{name}.tmp"
    if topology.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    if not tmp.is_dir():
        raise CheckpointError(
            f"rank {topology.rank}: {tmp} (made by rank 0) is not visible here: "
            "--save must be a directory on storage every node shares"
        )
    stamped = {**state, "layout": layout_of(topology)}
    file_name = rank_file_name(topology.tp_rank, topology.pp_rank, topology.dp_rank)
    try:
        checksum, failure = write_atomically(tmp / file_name, lambda f: torch.save(stamped, f)), ""
    except CheckpointError as exc:
        checksum, failure = "", f"rank {topology.rank}: {exc}"
    faults.maybe_raise("raise_after_rank_file", iteration, topology.rank)
    # the ranks meet here; every rank learns every rank's outcome, so a failed write stops all
    written = comm.all_gather_object((file_name, checksum, failure), tag="checkpoint")
    _raise_if_failed(root, tmp, iteration, [f for _, _, f in written], topology.rank)
    failure = ""
    if topology.rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "iteration": iteration,
            **layout_of(topology),
            CHECKSUMS_KEY: {name: digest for name, digest, _ in written},
            **(extra_metadata or {}),
        }
        try:
            write_atomically(tmp / METADATA_FILE, lambda f: f.write(json.dumps(meta).encode()))
            _commit(root, tmp, final, iteration)
        except CheckpointError as exc:
            failure = f"rank 0: {exc}"
        if not failure and keep_last is not None:
            remove_older(root, iteration, keep_last)
    _raise_if_failed(root, tmp, iteration, comm.all_gather_object(failure, tag="checkpoint/commit"), topology.rank)
    return final


def remove_older(root: Path, iteration: int, keep_last: int) -> None:
    """Rank 0, after checkpoint `iteration` is committed: remove the checkpoints below it but the
    newest `keep_last` - 1 of them. Checkpoints above it (left by a run
    that went further, when this one was allowed to move `latest` back) are not this rule's to
    judge. A removal that fails is a warning, not a failed save: the new checkpoint is complete."""
    for path in checkpoints_below(root, iteration)[keep_last - 1 :]:
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("checkpoint.keep_last = %d: could not remove %s (%s); it stays", keep_last, path, exc)


def _commit(root: Path, tmp: Path, final: Path, iteration: int) -> None:
    """Rank 0: rename the complete directory into place, then move `latest` to it."""
    name = final.name
    if final.exists():  # saving the same iteration again (a resumed run): replace it whole
        old = root / f"{name}.old"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)
    faults.maybe_raise("raise_before_latest", iteration, 0)
    write_atomically(root / LATEST_FILE, lambda f: f.write(f"{name}\n".encode()))
    fsync_dir(root)


def _raise_if_failed(root: Path, tmp: Path, iteration: int, failures: list[str], rank: int) -> None:
    """After a failed write: rank 0 removes the unfinished directory (it would keep a full
    disk full), and every rank raises the same error; `latest` was not touched."""
    failures = [f for f in failures if f]
    if not failures:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(
        f"checkpoint {checkpoint_name(iteration)} was not saved: "
        + "; ".join(failures)
        + f"; {root / LATEST_FILE} is unchanged"
    )


def check_save_dir(save_dir: str | os.PathLike[str], topology: Topology) -> None:
    """Collective, before step 1: every rank creates, writes and removes a probe file in
    `save_dir` (every rank writes its own file at each save), so an unwritable `--save` (a
    file, a read-only mount, no permission) stops the run before any step is computed rather
    than at the first save, possibly after the whole run."""
    root = Path(save_dir)
    probe = root / f".write_probe_rank{topology.rank}_{os.getpid()}"
    failure = ""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"megazpp write probe\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except FileExistsError:
        failure = f"rank {topology.rank}: {root} exists and is not a directory"
    except OSError as exc:
        failure = f"rank {topology.rank}: cannot write in {root} ({exc.strerror or exc})"
        with contextlib.suppress(OSError):  # a probe created before a failed write
            probe.unlink(missing_ok=True)
    failures = sorted({f for f in comm.all_gather_object(failure, tag="checkpoint/probe") if f})
    if failures:
        raise CheckpointError(f"--save {save_dir} is not writable: " + "; ".join(failures))


def check_not_behind(save_dir: str | os.PathLike[str], start_iteration: int) -> None:
    """Refuse a run that would move `save_dir`'s `latest` back: it starts at
    `start_iteration`, below the newest checkpoint there, so its saves would point `latest`
    at an older state and later overwrite the newer checkpoints."""
    root = Path(save_dir)
    pointer = root / LATEST_FILE
    try:
        name = pointer.read_text().strip()
    except OSError:
        return
    match = ITER_DIR.match(name)
    if match and int(match[1]) > start_iteration:
        raise CheckpointError(
            f"--save {save_dir}: its {LATEST_FILE} names {name}, newer than this run's start at "
            f"iteration {start_iteration}; saving would move {LATEST_FILE} back and overwrite the "
            "newer checkpoints. Resume it (--load with that directory), save elsewhere, or pass "
            "--overwrite-newer-checkpoints"
        )
