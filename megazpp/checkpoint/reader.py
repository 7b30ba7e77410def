"""A megazpp checkpoint read outside the run that wrote it: its metadata, checked, and any rank's
file (verified against its checksum, memory-mapped), one at a time.

A checkpoint (`format.py`) is `iter_N/` with `metadata.json` (format, iteration, world_size,
tp, pp, dp) and one `rank_tpXX_ppYYY_dpZZZZ.pt` per rank. Resharding (`reshard.py`,
`zero_shards.py`) and the exports and imports of `megazpp.interop` read through this class;
the model config is here because a weights-only checkpoint records it and an export needs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from megazpp.checkpoint.files import verify_checksum
from megazpp.checkpoint.format import (
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    MODEL_CONFIG_KEY,
    latest_checkpoint,
    rank_file_name,
)
from megazpp.errors import CheckpointError, ConfigError
from megazpp.model.config import ModelConfig
from megazpp.state import StateDict
from megazpp.unique_keys import JSONObject


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A save directory (its `latest` checkpoint) or an `iter_N` directory itself."""
    path = Path(path)
    if (path / METADATA_FILE).exists():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"{path}: neither a checkpoint directory (no {METADATA_FILE}) nor a save directory (no {LATEST_FILE})"
        )
    return found


class CheckpointReader:
    """Reads the model parts of one checkpoint (one rank file at a time, memory-mapped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = resolve_checkpoint(path)
        meta_file = self.path / METADATA_FILE
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{meta_file}: unreadable ({exc})") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{meta_file}: unknown checkpoint format {meta.get('format') if isinstance(meta, dict) else meta!r}"
            )
        for key in ("iteration", "tp", "pp", "dp"):
            if not isinstance(meta.get(key), int) or meta[key] < (0 if key == "iteration" else 1):
                raise CheckpointError(f"{meta_file}: {key} = {meta.get(key)!r} is not valid")
        self.meta: JSONObject = meta
        self.tp, self.pp, self.dp = meta["tp"], meta["pp"], meta["dp"]
        self.iteration: int = meta["iteration"]

    def model_config(self, given: ModelConfig | None = None) -> ModelConfig:
        """The model config saved in the checkpoint, or `given` (a run's checkpoints do not
        record it; then the run's config must be given). Both present must agree."""
        saved = self.meta.get(MODEL_CONFIG_KEY)
        if saved is None:
            if given is None:
                raise ConfigError(
                    f"{self.path / METADATA_FILE} does not record the model "
                    "config: give the training run's config (--config FILE)"
                )
            return given
        try:
            cfg = ModelConfig(**saved)
        except TypeError as exc:
            raise CheckpointError(
                f"{self.path / METADATA_FILE}: {MODEL_CONFIG_KEY} is not a model config ({exc})"
            ) from exc
        if given is not None and dataclasses.asdict(given) != dataclasses.asdict(cfg):
            diff = sorted(k for k, v in dataclasses.asdict(cfg).items() if getattr(given, k) != v)
            raise ConfigError(
                f"the given model config differs from the one saved in {self.path / METADATA_FILE} in {diff}"
            )
        return cfg

    def rank_file(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> Path:
        return self.path / rank_file_name(tp_rank, pp_rank, dp_rank)

    def rank_state(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> StateDict:
        file = self.rank_file(tp_rank, pp_rank, dp_rank)
        if not file.exists():
            raise CheckpointError(f"{file}: missing (checkpoint {self.path} is incomplete)")
        verify_checksum(file, self.meta)
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # any unpickling failure means an unusable file
            raise CheckpointError(f"{file}: cannot be loaded ({type(exc).__name__}: {exc})") from exc
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise CheckpointError(f"{file}: holds no 'model' state dict")
        return state
