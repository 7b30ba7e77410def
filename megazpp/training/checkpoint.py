"""Checkpoint files: per-rank state, written so that a crash never damages the last good one.

Layout of a save directory:

    latest                          text: the name of the newest complete checkpoint
    iter_0000100/
        metadata.json               iteration, format and parallel layout (written by rank 0)
        rank_tp00_pp000_dp0000.pt   one file per rank: its model part, engine state, RNGs, ...

Why this order of writes: every rank writes its file into `iter_N.tmp/` (each file itself
via a temporary name and a rename), all ranks meet, rank 0 adds `metadata.json`, renames the
directory to `iter_N`, and only then replaces `latest` (again via a temporary name). A crash
at any point leaves `latest` naming the previous checkpoint, which no step touched. Files are
read with `torch.load(weights_only=True)`: a checkpoint is data and never executes code.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megazpp.errors import CheckpointError
from megazpp.parallel.tensor_parallel import get_rng_tracker

FORMAT_VERSION = 1
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
_NAME = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(topology: Any) -> str:
    return f"rank_tp{topology.tp_rank:02d}_pp{topology.pp_rank:03d}_dp{topology.dp_rank:04d}.pt"


def layout_of(topology: Any) -> dict[str, int]:
    return {"world_size": topology.world_size, "tp": topology.tp, "pp": topology.pp,
            "dp": topology.dp}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write: Any) -> None:
    """`write(file)` into a temporary sibling, flush it to disk, then rename over `path`."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    from megazpp.parallel import comm

    comm.barrier(tag="checkpoint")


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, state: dict[str, Any],
                    topology: Any) -> Path:
    """Collectively save this rank's `state` as checkpoint `iteration`; return its directory."""
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
        raise CheckpointError(f"rank {topology.rank}: {tmp} (made by rank 0) is not visible here: "
                              "--save must be a directory on storage every node shares")
    _write_atomically(tmp / rank_file_name(topology), lambda f: torch.save(state, f))
    _barrier()
    if topology.rank == 0:
        meta = {"format": FORMAT_VERSION, "iteration": iteration, **layout_of(topology)}
        _write_atomically(tmp / METADATA_FILE, lambda f: f.write(json.dumps(meta).encode()))
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
        _write_atomically(root / LATEST_FILE, lambda f: f.write(f"{name}\n".encode()))
        _fsync_dir(root)
    _barrier()
    return final


def latest_checkpoint(load_dir: str | os.PathLike) -> Path | None:
    """The directory `latest` names, or None when nothing was saved there yet."""
    root = Path(load_dir)
    pointer = root / LATEST_FILE
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not _NAME.match(name):
        raise CheckpointError(f"{pointer}: expected a checkpoint name like 'iter_0000100', "
                              f"found {name[:80]!r}")
    path = root / name
    if not (path / METADATA_FILE).exists():
        raise CheckpointError(f"{path}: checkpoint named by {pointer} is missing or incomplete "
                              f"(no {METADATA_FILE})")
    return path


def load_checkpoint(load_dir: str | os.PathLike, topology: Any) -> dict[str, Any] | None:
    """This rank's state from `load_dir`'s latest checkpoint (None if there is none)."""
    path = latest_checkpoint(load_dir)
    if path is None:
        return None
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / METADATA_FILE}: unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path / METADATA_FILE}: unknown checkpoint format "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    saved = {k: meta.get(k) for k in layout_of(topology)}
    if saved != layout_of(topology):
        raise CheckpointError(f"{path}: saved with parallel layout {saved}, this run has "
                              f"{layout_of(topology)}")
    file = path / rank_file_name(topology)
    if not file.exists():
        raise CheckpointError(f"{file}: missing (checkpoint {path} is incomplete)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means an unusable file
        raise CheckpointError(f"{file}: cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("iteration") != meta["iteration"]:
        raise CheckpointError(f"{file}: holds iteration "
                              f"{state.get('iteration') if isinstance(state, dict) else '?'}, "
                              f"but {METADATA_FILE} says {meta['iteration']}")
    return state


def capture_rng_state() -> dict[str, Any]:
    """Every global RNG a step may draw from, in a form `weights_only` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tp_streams": get_rng_tracker().states(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tp_streams"])
