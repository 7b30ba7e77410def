"""Atomic, content-keyed `.npy` caches for dataset indices.

Index building is deterministic but not free (minutes on a large corpus), and in a multi-rank
job every rank asks for the same indices at once. Files are named by a hash of everything the
indices depend on, so a changed input can never load a stale index, and each writer saves
under a private temporary name and renames, so concurrent writers and interrupted runs never
leave a partial file under the final name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megazpp.unique_keys import JSONObject

log = logging.getLogger(__name__)


def cache_key(description: JSONObject, *arrays: np.ndarray) -> str:
    """A short hex digest of a JSON-able description plus the bytes of some arrays."""
    h = hashlib.sha256(json.dumps(description, sort_keys=True).encode())
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_or_build(
    paths: dict[str, Path], build: Callable[[], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays named in `paths`, loaded memory-mapped if all files exist, else built and saved.

    Returns (arrays, built). A cache directory that cannot be written (a read-only dataset)
    only costs the rebuild at every start, so that is one line per directory and process (the
    train, valid and max-token caches of one dataset share it), not an error.
    """
    if all(p.is_file() for p in paths.values()):
        try:
            return {k: np.load(p, mmap_mode="r") for k, p in paths.items()}, False
        except (OSError, ValueError):
            pass  # unreadable cache file: rebuild it below
    arrays = build()
    try:
        for name, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            save_atomic(path, arrays[name])
    except OSError as e:
        _say_uncached(next(iter(paths.values())).parent, e)
    return arrays, True


_told: set[Path] = set()  # directories already named by `_say_uncached` in this process


def _say_uncached(directory: Path, error: OSError) -> None:
    """What failed, where, and what it costs: said once per directory (on rank 0: every rank
    meets the same directory)."""
    if directory in _told:
        return
    _told.add(directory)
    log.info(
        "data: cannot write the dataset's index caches in %s (%s): its indices (sample order, "
        "largest token id) are rebuilt at every start instead of loaded; training is unaffected",
        directory,
        error.strerror or error,
    )
