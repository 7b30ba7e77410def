"""Full (unsharded) weights out of any megazpp checkpoint, and the common export options.

The two exporters (Hugging Face directory, one safetensors file) share this path: read every
(tp, pp) part, glue the TP shards along their split dimension, join the pipeline stages,
optionally cast. Reading goes through CheckpointReader, the one place that knows which rank
files and which engine state hold a part's weights, so supporting ZeRO-sharded checkpoints
there makes both exports work for them. An adapters-only checkpoint's frozen weights come from
the base it records (an import, or the model's init), checked unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megazpp.checkpoint.format import CONFIG_KEY, is_two_level
from megazpp.checkpoint.frozen_base import check_base, recorded_base
from megazpp.checkpoint.reader import CheckpointReader
from megazpp.errors import ConfigError
from megazpp.interop.checkpoint_io import part_weights
from megazpp.interop.model_layout import merge_stages, merge_tp_shards, shard_for_rank, stage_layouts
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.outer.diloco import OUTER_STATE_KEY
from megazpp.outer.fragments import due_fragments, last_landed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """None keeps each tensor's saved dtype."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def cast(weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: v if dtype is None else v.to(dtype) for k, v in weights.items()}


def base_weights(reader: CheckpointReader, cfg: ModelConfig) -> dict[str, torch.Tensor] | None:
    """The full weights of the base an adapters-only checkpoint records (refused when missing
    or changed); None for a checkpoint that holds every weight."""
    base = recorded_base(reader.path, reader.meta)
    if base is None:
        return None
    check_base(reader.path, base, cfg.init_seed)
    if base.load is None:  # the init, seeded per parameter name whatever the layout
        return dict(GPTModel(cfg).state_dict())
    imported = CheckpointReader(base.load)
    return consolidated_weights(imported, imported.model_config())


def consolidated_weights(
    reader: CheckpointReader, cfg: ModelConfig, *, masters: bool = False
) -> dict[str, torch.Tensor]:
    """Full weights keyed like the single-process model's parameters. `masters` takes the
    fp32 master copies of a bf16/fp16 run (the precise values the optimizer updates) instead
    of the rounded model weights."""
    stages = stage_layouts(cfg, reader.tp, reader.pp)
    base = base_weights(reader, cfg)
    merged: list[Mapping[str, torch.Tensor]] = []
    for stage in stages:
        parts: list[Mapping[str, torch.Tensor]] = []
        for tp_rank in range(reader.tp):
            part = part_weights(reader, tp_rank, stage.pp_rank, stage, masters)
            if base is not None:  # an adapters-only checkpoint: the frozen weights are the base's
                absent = [k for k in stage.keys if k not in part]
                part = {**shard_for_rank(base, stage, cfg, reader.tp, tp_rank, absent), **part}
            parts.append(part)
        merged.append(merge_tp_shards(parts, stage, f"{reader.path} (pipeline stage {stage.pp_rank})"))
    return merge_stages(merged, cfg, str(reader.path))


def two_level_note(path: str) -> str | None:
    """For a two-level (DiLoCo) checkpoint, the line an export prints: it holds the islands'
    common parameters at their last outer sync (`zero_shards._at_last_sync`), not any island's
    own since, and which sync that is for each fragment (`fragments.last_landed`: fragments
    sync at staggered steps, and an exchange in flight is not applied yet); None for any other
    checkpoint."""
    reader = CheckpointReader(path)
    if not is_two_level(reader.meta):
        return None  # a synchronous run's, or a two-level run's before its outer.start_iter
    outer = reader.meta[CONFIG_KEY]["outer"]
    state = reader.rank_state(0, 0, 0)["engine"][OUTER_STATE_KEY]
    every, inner_steps, count = int(state["sync_every"]), int(state["inner_steps"]), len(state["fragments"])
    overlap = int(outer.get("overlap_steps", 0))

    def iteration(inner_step: int) -> int:  # inner steps count from the run's (or its warm) start
        return reader.iteration - inner_steps + inner_step

    def held(f: int, landed: int | None) -> str:
        at = f"iteration {iteration(landed)}" if landed is not None else "none yet: the parameters it started from"
        flying = [s for s in range(inner_steps - overlap + 1, inner_steps + 1) if f in due_fragments(s, every, count)]
        return at + "".join(f", its exchange of iteration {iteration(s)} in flight" for s in flying)

    landed = last_landed(inner_steps, every, count, overlap)
    what = (
        f"at the last outer sync ({held(0, landed[0])}; every {every} steps)"
        if count == 1
        else f"at each fragment's last applied outer sync ({count} fragments, every {every} steps, "
        f"overlap {overlap}): " + "; ".join(f"fragment {f} at {held(f, at)}" for f, at in enumerate(landed))
    )
    return (
        f"note: {reader.path} is a two-level ({outer['algorithm']}) checkpoint at iteration {reader.iteration}: "
        f"exported are the islands' averaged parameters {what}; not any island's own since"
    )
