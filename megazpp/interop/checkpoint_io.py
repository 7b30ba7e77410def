"""megazpp checkpoints as seen from outside a training run: any rank's model part (read through
`megazpp.checkpoint.reader.CheckpointReader`), and a weights-only checkpoint written for a chosen
tensor/pipeline layout.

A checkpoint (see megazpp/checkpoint/format.py) is `iter_N/` with `metadata.json` (format,
iteration, world_size, tp, pp, dp) and one `rank_tpXX_ppYYY_dpZZZZ.pt` per rank holding
{"model": that rank's model state dict, "engine": its optimizer engine's state, ...}.

Where the weights of a (tp_rank, pp_rank) part live depends on the engine that wrote it:
- LocalEngine (dp = 1): "model" holds the part's weights in the model dtype; with bf16/fp16
  its fp32 masters are engine["masters"], a list in `named_parameters` order.
- ZeRO engines (engine state carries "strategy" = "pgo", e.g. "NNG"): with parameters
  replicated (p = N) DP rank 0's "model" holds the whole part and is read. Released
  parameters (p = I or G, saved as empty tensors) and the sharded fp32 masters are
  reassembled from the flat bucket shards of every DP rank (`megazpp/checkpoint/zero_shards.py`).

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

from megazpp.checkpoint.files import write_atomically
from megazpp.checkpoint.format import (
    CHECKSUMS_KEY,
    CONFIG_KEY,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    MODEL_CONFIG_KEY,
    WEIGHTS_ONLY_KEY,
    checkpoint_name,
    layout_of,
    rank_file_name,
)
from megazpp.checkpoint.reader import CheckpointReader
from megazpp.checkpoint.zero_shards import consolidated_part
from megazpp.errors import CheckpointError
from megazpp.interop.model_layout import StageLayout, layout_topology, shard_for_rank, stage_layouts
from megazpp.model.config import ModelConfig
from megazpp.outer.diloco import OUTER_STATE_KEY
from megazpp.unique_keys import JSONObject


def _zero_strategy(engine_state: object) -> str | None:
    """The PaRO strategy of a ZeRO engine's saved state, None for LocalEngine state."""
    if isinstance(engine_state, dict) and "strategy" in engine_state:
        return str(engine_state["strategy"])
    return None


def _is_whole(model: Mapping[str, torch.Tensor], stage: StageLayout, tp: int) -> bool:
    """False when a ZeRO run saved released (empty) parameters (p = I / G)."""
    return all(model[key].shape == stage.shard_shape(key, tp) for key in stage.keys if key in model)


def part_weights(
    reader: CheckpointReader, tp_rank: int, pp_rank: int, stage: StageLayout, masters: bool
) -> dict[str, torch.Tensor]:
    """The (tp_rank, pp_rank) part's state dict: the model's tensors as saved, or with
    `masters` the optimizer's fp32 master copies where the run kept them (bf16/fp16)."""
    file = reader.rank_file(tp_rank, pp_rank)
    state = reader.rank_state(tp_rank, pp_rank)
    engine = state.get("engine")
    strategy = _zero_strategy(engine)
    model: dict[str, torch.Tensor] = state["model"]  # a rank file's model state (torch.load is untyped)
    if strategy is not None:
        # a two-level checkpoint's rank holds its island's own weights: the export takes the
        # islands' common ones at the last outer sync, from the shards (`zero_shards._at_last_sync`)
        if masters or (engine is not None and OUTER_STATE_KEY in engine) or not _is_whole(model, stage, reader.tp):
            return consolidated_part(reader, tp_rank, pp_rank, model, masters)
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
