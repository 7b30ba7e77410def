"""Loading a checkpoint, collectively: every rank uses it or none does.

Why loading is collective: every rank checks that all rank files exist, that its own file
holds the metadata's iteration and layout, and then all ranks agree on the verdict, so a
checkpoint is used by every rank or by none (a half-loaded job would train on a mixture).
A refused checkpoint is an error unless the caller asked to fall back to older ones. Files
are read with `torch.load(weights_only=True)`: a checkpoint is data and never executes code.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from megazpp.checkpoint.files import verify_checksum
from megazpp.checkpoint.format import (
    LATEST_FILE,
    METADATA_FILE,
    WEIGHTS_ONLY_KEY,
    LoadedCheckpoint,
    checkpoints_below,
    expected_rank_files,
    latest_checkpoint,
    layout_of,
    rank_file_name,
    read_metadata,
)
from megazpp.errors import CheckpointError
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.state import StateDict
from megazpp.unique_keys import JSONObject


def check_loadable(load_dir: str | os.PathLike[str]) -> None:
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


def _read_verified(path: Path, topology: Topology) -> tuple[JSONObject, StateDict]:
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
    older = checkpoints_below(root, int(named.name[5:]) if named is not None else None)
    return ([named] if named is not None else []) + older


def load_checkpoint(
    load_dir: str | os.PathLike[str], topology: Topology, *, fallback: bool = False
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
    model: torch.nn.Module, weights: dict[str, torch.Tensor], keep_own: Callable[[str], bool] | None = None
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
