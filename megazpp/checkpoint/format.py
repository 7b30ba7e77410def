"""The checkpoint format: what a save directory holds, its names, and reading its metadata.

Layout of a save directory:

    latest                          text: the name of the newest complete checkpoint
    iter_0000100/
        metadata.json               iteration, format, parallel layout, checksums, model config,
                                    the run's resolved config (rank 0)
        rank_tp00_pp000_dp0000.pt   one file per rank: its model part, engine state, RNGs, ...
                                    and the layout it was written under

The modules beside this one each do one job on this format: `files` writes a file
atomically and checks its checksum, `save` writes a checkpoint (the commit order that
keeps the last good one safe), `load` reads and verifies one collectively,
`rng_state` is the RNG part of a rank file. What a run loads and when it saves is decided in
one place, `manager`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megazpp.errors import CheckpointError
from megazpp.parallel.topology import Topology
from megazpp.state import StateDict
from megazpp.unique_keys import JSONObject

FORMAT_VERSION = 1
LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
WEIGHTS_ONLY_KEY = "weights_only"
MODEL_CONFIG_KEY = "model_config"
CONFIG_KEY = "config"  # the run's whole resolved config, as Megatron saves its args
CHECKSUMS_KEY = "checksums"  # metadata.json: rank file name -> "sha256:<hex>"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")  # a checkpoint directory's name


def is_two_level(meta: JSONObject) -> bool:
    """Whether a run's checkpoint (its `metadata.json`) holds the islands' state: saved by a
    two-level run at or after its `outer.start_iter` (before it, the run was synchronous and so
    is its checkpoint: `training/start_iter.py`)."""
    outer = (meta.get(CONFIG_KEY) or {}).get("outer") or {}
    return outer.get("algorithm", "none") != "none" and int(meta.get("iteration", 0)) >= int(outer.get("start_iter", 0))


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"rank_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:04d}.pt"


def layout_of(topology: Topology) -> dict[str, int]:
    return {"world_size": topology.world_size, "tp": topology.tp, "pp": topology.pp, "dp": topology.dp}


def expected_rank_files(layout: Mapping[str, int]) -> list[str]:
    """Every rank file a complete checkpoint of `layout` (tp, pp, dp) holds."""
    return [
        rank_file_name(t, p, d) for p in range(layout["pp"]) for d in range(layout["dp"]) for t in range(layout["tp"])
    ]


def latest_checkpoint(load_dir: str | os.PathLike[str]) -> Path | None:
    """The directory `latest` names, or None when nothing was saved there yet."""
    root = Path(load_dir)
    pointer = root / LATEST_FILE
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not ITER_DIR.match(name):
        raise CheckpointError(f"{pointer}: expected a checkpoint name like 'iter_0000100', found {name[:80]!r}")
    path = root / name
    if not (path / METADATA_FILE).exists():
        raise CheckpointError(f"{path}: checkpoint named by {pointer} is missing or incomplete (no {METADATA_FILE})")
    return path


def checkpoints_below(root: Path, limit: int | None) -> list[Path]:
    """The `iter_N` directories in `root` with N below `limit` (all, for None), newest first:
    the fallback's candidates and what `checkpoint.keep_last` may remove."""
    found = [p for p in root.iterdir() if p.is_dir() and ITER_DIR.match(p.name)]
    below = [p for p in found if limit is None or int(p.name[5:]) < limit]
    return sorted(below, key=lambda p: int(p.name[5:]), reverse=True)


def is_weights_only(load_dir: str | os.PathLike[str]) -> bool:
    """Whether `load_dir`'s latest checkpoint is an import (model weights, no run state)."""
    path = latest_checkpoint(load_dir)
    return path is not None and bool(read_metadata(path).get(WEIGHTS_ONLY_KEY))


@dataclass
class LoadedCheckpoint:
    """This rank's state from a checkpoint every rank verified."""

    path: Path
    metadata: JSONObject  # metadata.json
    state: StateDict

    def __getitem__(self, key: str) -> Any:
        """`loaded["engine"]`: an entry of this rank's state."""
        return self.state[key]

    @property
    def weights_only(self) -> bool:
        """An imported checkpoint: model weights to start from, no run state to resume."""
        return bool(self.metadata.get(WEIGHTS_ONLY_KEY))


def read_metadata(path: Path) -> JSONObject:
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
