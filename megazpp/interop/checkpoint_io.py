"""megazpp checkpoints as seen from outside a training run: read any rank's model part, and
write a weights-only checkpoint for a chosen tensor/pipeline layout.

A checkpoint (see megazpp/training/checkpoint.py) is `iter_N/` with `metadata.json` (format,
iteration, world_size, tp, pp, dp) and one `rank_tpXX_ppYYY_dpZZZZ.pt` per rank holding
{"model": that rank's model state dict, "engine": its optimizer engine's state, ...}.

Where the weights of a (tp_rank, pp_rank) part live depends on the engine that wrote it:
- LocalEngine (dp = 1): "model" holds the part's weights in the model dtype; with bf16/fp16
  its fp32 masters are engine["masters"], a list in `named_parameters` order.
- ZeRO engines (engine state carries "strategy" = "pgo", e.g. "NNG"): with parameters
  replicated (p = N) DP rank 0's "model" holds the whole part and is read. Released
  parameters (p = I or G, saved as empty tensors) and the sharded fp32 masters are
  reassembled from the flat bucket shards of every DP rank (`zero_shards.py`).

Weights-only checkpoints (what an import writes) hold {"iteration": 0, "consumed_samples": 0,
"model": ...} per rank and record the model config and `"weights_only": true` in
metadata.json, so exports need no separate config and a loader can tell them from a run's
checkpoints (they have no optimizer state to resume).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from megazpp.errors import CheckpointError, ConfigError
from megazpp.interop.model_layout import StageLayout, layout_topology, shard_for_rank, stage_layouts
from megazpp.interop.zero_shards import OUTER_KEY, consolidated_part
from megazpp.model.config import ModelConfig
from megazpp.state import StateDict
from megazpp.training.checkpoint import (
    CHECKSUMS_KEY,
    CONFIG_KEY,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    MODEL_CONFIG_KEY,
    WEIGHTS_ONLY_KEY,
    checkpoint_name,
    latest_checkpoint,
    layout_of,
    rank_file_name,
)
from megazpp.training.checkpoint_files import verify_checksum, write_atomically
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


def _zero_strategy(engine_state: object) -> str | None:
    """The PaRO strategy of a ZeRO engine's saved state, None for LocalEngine state."""
    if isinstance(engine_state, dict) and "strategy" in engine_state:
        return str(engine_state["strategy"])
    return None


def _is_whole(model: Mapping[str, torch.Tensor], stage: StageLayout, tp: int) -> bool:
    """False when a ZeRO run saved released (empty) parameters (p = I / G)."""
    return all(model[key].shape == stage.shard_shape(key, tp) for key in stage.keys if key in model)


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
        self.iteration = meta["iteration"]

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
            return given.validate()
        try:
            cfg = ModelConfig(**saved).validate()
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
        topo = layout_topology(self.tp, self.pp, tp_rank, pp_rank, dp=self.dp, dp_rank=dp_rank)
        return self.path / rank_file_name(topo.tp_rank, topo.pp_rank, topo.dp_rank)

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

    def part_weights(self, tp_rank: int, pp_rank: int, stage: StageLayout, masters: bool) -> dict[str, torch.Tensor]:
        """The (tp_rank, pp_rank) part's state dict: the model's tensors as saved, or with
        `masters` the optimizer's fp32 master copies where the run kept them (bf16/fp16)."""
        file = self.rank_file(tp_rank, pp_rank)
        state = self.rank_state(tp_rank, pp_rank)
        engine = state.get("engine")
        strategy = _zero_strategy(engine)
        model = state["model"]
        if strategy is not None:
            # a two-level checkpoint's rank holds its island's own weights: the export takes the
            # islands' common ones at the last outer sync, from the shards (`zero_shards._at_last_sync`)
            if masters or (engine is not None and OUTER_KEY in engine) or not _is_whole(model, stage, self.tp):
                return consolidated_part(self, tp_rank, pp_rank, model, masters)
            return model
        if not masters or engine is None or engine.get("masters") is None:
            return model
        saved = engine["masters"]
        if len(saved) != len(stage.parameter_names):
            raise CheckpointError(f"{file}: {len(saved)} fp32 masters for {len(stage.parameter_names)} parameters")
        out = dict(model)
        out.update(zip(stage.parameter_names, saved))
        return out


def saved_tokenizer(path: str | os.PathLike[str]) -> str | None:
    """The tokenizer model the checkpoint's run trained with (from the resolved config that
    training saves), when that file still exists; None otherwise."""
    meta = CheckpointReader(path).meta
    name = (meta.get(CONFIG_KEY) or {}).get("data", {}).get("tokenizer_model")
    return name if name and Path(name).is_file() else None


def write_weights_checkpoint(
    save_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    full: Mapping[str, torch.Tensor],
    tp: int,
    pp: int,
    extra_meta: JSONObject | None = None,
) -> Path:
    """Write `full` weights as iteration 0 of a tp x pp (dp = 1) checkpoint in a new or empty
    `save_dir`; return the checkpoint directory.

    Same commit protocol as training saves: rank files (each atomically) into `iter_N.tmp`,
    then metadata, a directory rename and the `latest` pointer last, so a crash never leaves
    a directory that looks complete. An existing checkpoint is never overwritten.
    """
    root = Path(save_dir)
    if (root / LATEST_FILE).exists() or any(root.glob("iter_*")):
        raise CheckpointError(f"{root}: already holds checkpoints; choose a new directory")
    stages = stage_layouts(cfg, tp, pp)
    name = checkpoint_name(0)
    final, tmp = root / name, root / f"{name}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    checksums = {}
    for stage in stages:
        for tp_rank in range(tp):
            part = shard_for_rank(full, stage, cfg, tp, tp_rank)
            state = {"iteration": 0, "consumed_samples": 0, "model": part}
            file_name = rank_file_name(tp_rank, stage.pp_rank, 0)
            checksums[file_name] = write_atomically(tmp / file_name, functools.partial(torch.save, state))
    meta = {
        "format": FORMAT_VERSION,
        "iteration": 0,
        **layout_of(layout_topology(tp, pp)),
        WEIGHTS_ONLY_KEY: True,
        MODEL_CONFIG_KEY: dataclasses.asdict(cfg),
        CHECKSUMS_KEY: checksums,
        **(extra_meta or {}),
    }
    write_atomically(tmp / METADATA_FILE, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    tmp.rename(final)
    write_atomically(root / LATEST_FILE, lambda f: f.write(f"{name}\n".encode()))
    return final
