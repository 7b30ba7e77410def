"""Checkpoint files: per-rank state, written so that a crash never damages the last good one.

Layout of a save directory:

    latest                          text: the name of the newest complete checkpoint
    iter_0000100/
        metadata.json               iteration, format, parallel layout, model config (rank 0)
        rank_tp00_pp000_dp0000.pt   one file per rank: its model part, engine state, RNGs, ...
                                    and the layout it was written under

Why this order of writes: every rank writes its file into `iter_N.tmp/` (each file itself
via a temporary name and a rename), all ranks meet, rank 0 adds `metadata.json`, renames the
directory to `iter_N`, and only then replaces `latest` (again via a temporary name). A crash
at any point leaves `latest` naming the previous checkpoint, which no step touched.

Why loading is collective: every rank checks that all rank files exist, that its own file
holds the metadata's iteration and layout, and then all ranks agree on the verdict, so a
checkpoint is used by every rank or by none (a half-loaded job would train on a mixture).
A refused checkpoint is an error unless the caller asked to fall back to older ones. Files
are read with `torch.load(weights_only=True)`: a checkpoint is data and never executes code.

Why a checksum per file: a flipped bit in a tensor's exponent loads without complaint and
turns the loss to 1e34; each rank hashes its file while writing it, `metadata.json` records
the digests, and a file whose bytes differ is refused like any other damaged checkpoint.
A failed write (a full disk) removes what it had written, so `latest` and the disk are as
they were before the save.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch

from megazpp.errors import CheckpointError
from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import get_rng_tracker
from megazpp.parallel.topology import Topology
from megazpp.training import faults

FORMAT_VERSION = 1
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
WEIGHTS_ONLY_KEY = "weights_only"
MODEL_CONFIG_KEY = "model_config"
CONFIG_KEY = "config"  # the run's whole resolved config, as Megatron saves its args
CHECKSUMS_KEY = "checksums"  # metadata.json: rank file name -> "sha256:<hex>"
_NAME = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"rank_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:04d}.pt"


def layout_of(topology: Topology) -> dict[str, int]:
    return {"world_size": topology.world_size, "tp": topology.tp, "pp": topology.pp, "dp": topology.dp}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that hashes what passes through it and remembers the OSError a write met
    (torch.save reports a failed write as a RuntimeError that no longer says why)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.digest.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def _write_failure(path: Path, exc: OSError) -> CheckpointError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left on the device of {path.parent} (writing "
            f"{path.name}; {exc.strerror}): the partial file was removed"
        )
    return CheckpointError(f"cannot write {path} ({exc.strerror or exc}): the partial file was removed")


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> str:
    """`write(file)` into a temporary sibling, flush it to disk, then rename over `path`: a
    reader sees the old file or the whole new one, never a torn write. Returns the written
    bytes' checksum ("sha256:<hex>"). A write that fails for lack of space or another OS
    error removes the temporary file and raises CheckpointError saying why."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer: _HashingWriter | None = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)  # type: ignore[arg-type]  # a write()/flush() file is what savers use
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        cause = writer.error if writer is not None and writer.error is not None else exc
        if isinstance(cause, OSError):
            raise _write_failure(path, cause) from exc
        raise
    return f"sha256:{writer.digest.hexdigest()}"


def verify_checksum(file: Path, metadata: dict[str, Any]) -> None:
    """Refuse `file` when its bytes differ from the checksum `metadata` records for it
    (checkpoints written before checksums were recorded have none: nothing to compare)."""
    checksums = metadata.get(CHECKSUMS_KEY)
    expected = checksums.get(file.name) if isinstance(checksums, dict) else None
    if expected is None:
        return
    actual = file_checksum(file)
    if actual != expected:
        raise CheckpointError(
            f"{file}: checksum mismatch ({actual[:19]}..., {METADATA_FILE} "
            f"records {str(expected)[:19]}...): the file changed after it "
            "was written (disk, copy or memory corruption)"
        )


def file_checksum(path: Path) -> str:
    """ "sha256:<hex>" of a file's bytes, read in blocks (rank files can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _barrier() -> None:
    comm.barrier(tag="checkpoint")


def expected_rank_files(layout: dict[str, Any]) -> list[str]:
    """Every rank file a complete checkpoint of `layout` (tp, pp, dp) holds."""
    return [
        rank_file_name(t, p, d) for p in range(layout["pp"]) for d in range(layout["dp"]) for t in range(layout["tp"])
    ]


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    state: dict[str, Any],
    topology: Topology,
    extra_metadata: dict[str, Any] | None = None,
) -> Path:
    """Collectively save this rank's `state` as checkpoint `iteration`; return its directory.

    Each rank file is stamped with the layout it was written under, so a loader can tell a
    stray file of another run from this checkpoint's. `extra_metadata` (e.g. the model
    config) goes into `metadata.json`.
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
    _raise_if_failed(root, tmp, iteration, comm.all_gather_object(failure, tag="checkpoint/commit"), topology.rank)
    return final


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
    _fsync_dir(root)
    faults.maybe_raise("raise_before_latest", iteration, 0)
    write_atomically(root / LATEST_FILE, lambda f: f.write(f"{name}\n".encode()))
    _fsync_dir(root)


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


def check_save_dir(save_dir: str | os.PathLike, topology: Topology) -> None:
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


def check_loadable(load_dir: str | os.PathLike) -> None:
    """`--load DIR` must name a directory with a `latest` checkpoint: a mistyped path would
    otherwise start from scratch and, with `--save` on the real directory, overwrite its
    checkpoints. Names the closest sibling directory when there is one."""
    root = Path(load_dir)
    if (root / LATEST_FILE).exists():
        return
    if root.is_dir():
        found = f"{root} holds no {LATEST_FILE} file (no checkpoint was completed there)"
    else:
        found = f"{root} does not exist"
        parent = root.parent if str(root.parent) else Path(".")
        siblings = [p.name for p in parent.iterdir() if p.is_dir()] if parent.is_dir() else []
        close = difflib.get_close_matches(root.name, siblings, n=1, cutoff=0.6)
        if close:
            found += f" (did you mean {parent / close[0]}?)"
    raise CheckpointError(
        f"--load {load_dir}: nothing to load, {found}; pass --load-optional "
        "to start from scratch when it holds no checkpoint"
    )


def check_not_behind(save_dir: str | os.PathLike, start_iteration: int) -> None:
    """Refuse a run that would move `save_dir`'s `latest` back: it starts at
    `start_iteration`, below the newest checkpoint there, so its saves would point `latest`
    at an older state and later overwrite the newer checkpoints."""
    root = Path(save_dir)
    pointer = root / LATEST_FILE
    try:
        name = pointer.read_text().strip()
    except OSError:
        return
    match = _NAME.match(name)
    if match and int(match[1]) > start_iteration:
        raise CheckpointError(
            f"--save {save_dir}: its {LATEST_FILE} names {name}, newer than this run's start at "
            f"iteration {start_iteration}; saving would move {LATEST_FILE} back and overwrite the "
            "newer checkpoints. Resume it (--load with that directory), save elsewhere, or pass "
            "--overwrite-newer-checkpoints"
        )


def latest_checkpoint(load_dir: str | os.PathLike) -> Path | None:
    """The directory `latest` names, or None when nothing was saved there yet."""
    root = Path(load_dir)
    pointer = root / LATEST_FILE
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not _NAME.match(name):
        raise CheckpointError(f"{pointer}: expected a checkpoint name like 'iter_0000100', found {name[:80]!r}")
    path = root / name
    if not (path / METADATA_FILE).exists():
        raise CheckpointError(f"{path}: checkpoint named by {pointer} is missing or incomplete (no {METADATA_FILE})")
    return path


def is_weights_only(load_dir: str | os.PathLike) -> bool:
    """Whether `load_dir`'s latest checkpoint is an import (model weights, no run state)."""
    path = latest_checkpoint(load_dir)
    return path is not None and bool(read_metadata(path).get(WEIGHTS_ONLY_KEY))


@dataclass
class LoadedCheckpoint:
    """This rank's state from a checkpoint every rank verified."""

    path: Path
    metadata: dict[str, Any]
    state: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        """`loaded["engine"]`: an entry of this rank's state."""
        return self.state[key]

    @property
    def weights_only(self) -> bool:
        """An imported checkpoint: model weights to start from, no run state to resume."""
        return bool(self.metadata.get(WEIGHTS_ONLY_KEY))


def read_metadata(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / METADATA_FILE}: missing or unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / METADATA_FILE}: unknown checkpoint format "
            f"{meta.get('format') if isinstance(meta, dict) else meta!r}"
        )
    if not isinstance(meta.get("iteration"), int) or any(
        not isinstance(meta.get(k), int) or meta[k] < 1 for k in ("world_size", "tp", "pp", "dp")
    ):
        raise CheckpointError(f"{path / METADATA_FILE}: iteration or layout missing or invalid")
    return meta


def _read_verified(path: Path, topology: Topology) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, this rank's state) of checkpoint `path`, or CheckpointError saying why not.

    A weights-only checkpoint must match in tp and pp only: every DP rank reads DP rank 0's
    file, so it starts any data-parallel size.
    """
    meta = read_metadata(path)
    weights_only = bool(meta.get(WEIGHTS_ONLY_KEY))
    mine = layout_of(topology)
    keys = ("tp", "pp") if weights_only else tuple(mine)
    saved = {k: meta[k] for k in keys}
    if saved != {k: mine[k] for k in keys}:
        raise CheckpointError(
            f"{path}: saved with parallel layout {saved}, this run has { {k: mine[k] for k in keys} }"
        )
    missing = [f for f in expected_rank_files(meta) if not (path / f).is_file()]
    if missing:
        raise CheckpointError(
            f"{path}: incomplete checkpoint, missing rank files {missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    file = path / rank_file_name(topology.tp_rank, topology.pp_rank, 0 if weights_only else topology.dp_rank)
    verify_checksum(file, meta)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means an unusable file
        raise CheckpointError(f"{file}: cannot be loaded as checkpoint data ({_load_failure(exc)})") from exc
    if not isinstance(state, dict) or state.get("iteration") != meta["iteration"]:
        raise CheckpointError(
            f"{file}: holds iteration "
            f"{state.get('iteration') if isinstance(state, dict) else '?'}, "
            f"but {METADATA_FILE} says {meta['iteration']}"
        )
    stamp = state.get("layout")
    described = {k: meta[k] for k in layout_of(topology)}
    if stamp is not None and stamp != described:
        raise CheckpointError(
            f"{file}: written under parallel layout {stamp}, but {METADATA_FILE} describes {described}"
        )
    return meta, state


def _load_failure(exc: Exception) -> str:
    """The informative line of a torch.load failure. torch's weights-only refusal is a page
    ending in advice to load with weights_only=False, which must never be followed for a
    file of unknown origin; keep only what it found."""
    text = str(exc)
    refused = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    if refused:
        return f"{type(exc).__name__}: not tensors and plain data ({refused[1].strip()[:200]})"
    return f"{type(exc).__name__}: {text.strip().splitlines()[0][:200] if text.strip() else ''}"


def _candidates(root: Path, fallback: bool) -> list[Path]:
    """The checkpoint `latest` names; with `fallback`, then every older `iter_N` directory."""
    try:
        named = latest_checkpoint(root)
    except CheckpointError:
        if not fallback:
            raise
        named = None
    if not fallback:
        return [named] if named is not None else []
    limit = int(named.name[5:]) if named is not None else None
    older = sorted(
        (
            p
            for p in root.iterdir()
            if _NAME.match(p.name) and p.is_dir() and (limit is None or int(p.name[5:]) < limit)
        ),
        key=lambda p: int(p.name[5:]),
        reverse=True,
    )
    return ([named] if named is not None else []) + older


def load_checkpoint(
    load_dir: str | os.PathLike, topology: Topology, *, fallback: bool = False
) -> LoadedCheckpoint | None:
    """Collectively load the checkpoint `latest` names (None when `latest` does not exist).

    Every rank verifies its part and all ranks agree on the verdict, so either every rank
    loads the same checkpoint or all raise CheckpointError. With `fallback`, a refused
    checkpoint is skipped for the next older complete one (never silently: the reasons are
    in the warning and in the final error if none loads).
    """
    root = Path(load_dir)
    if not (root / LATEST_FILE).exists():
        return None
    refused: list[str] = []
    for path in _candidates(root, fallback):
        try:
            meta, state = _read_verified(path, topology)
            verdict = ""
        except CheckpointError as exc:
            meta, state, verdict = {}, {}, str(exc)
        verdicts = comm.all_gather_object(verdict, tag="checkpoint/verify")
        reasons = sorted({v for v in verdicts if v})
        if not reasons:
            if refused:
                warnings.warn(f"--load-fallback: loading {path} instead; refused: " + "; ".join(refused), stacklevel=2)
            return LoadedCheckpoint(path, meta, state)
        refused.append("; ".join(reasons))
    if not refused:
        raise CheckpointError(f"{root}: {LATEST_FILE} names no checkpoint and no complete iter_N directory exists")
    hint = "" if fallback else " (pass --load-fallback to load the previous complete checkpoint)"
    raise CheckpointError(f"{root}: no loadable checkpoint: " + " | ".join(refused) + hint)


def load_model_weights(
    model: torch.nn.Module, weights: dict[str, Any], keep_own: Callable[[str], bool] | None = None
) -> None:
    """`model.load_state_dict(weights)`, with a mismatch (another model shape or layout)
    reported as a CheckpointError naming the first differing tensors. Tensors the checkpoint
    lacks and `keep_own(name)` accepts keep the model's values (the LoRA adapters a fine-tune
    adds to imported base weights)."""
    if keep_own is not None:
        own = {k: v for k, v in model.state_dict().items() if k not in weights and keep_own(k)}
        weights = {**weights, **own}
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint weights do not fit this model: {str(exc).strip()[:600]}") from exc


def capture_rng_state() -> dict[str, Any]:
    """Every global RNG a step may draw from, in a form `weights_only` loading accepts."""
    # legacy=True (the default) returns the tuple form
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tp_streams": get_rng_tracker().states(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tp_streams"])
