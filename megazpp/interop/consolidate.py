"""Full (unsharded) weights out of any megazpp checkpoint, and the common export options.

The two exporters (Hugging Face directory, one safetensors file) share this path: read every
(tp, pp) part, glue the TP shards along their split dimension, join the pipeline stages,
optionally cast. Reading goes through CheckpointReader, the one place that knows which rank
files and which engine state hold a part's weights, so supporting ZeRO-sharded checkpoints
there makes both exports work for them.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megazpp.errors import ConfigError
from megazpp.interop.checkpoint_io import CheckpointReader
from megazpp.interop.model_layout import merge_stages, merge_tp_shards, stage_layouts
from megazpp.model.config import ModelConfig

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


def consolidated_weights(reader: CheckpointReader, cfg: ModelConfig, *,
                         masters: bool = False) -> dict[str, torch.Tensor]:
    """Full weights keyed like the single-process model's parameters. `masters` takes the
    fp32 master copies of a bf16/fp16 run (the precise values the optimizer updates) instead
    of the rounded model weights."""
    stages = stage_layouts(cfg, reader.tp, reader.pp)
    merged = []
    for stage in stages:
        parts = [reader.part_weights(tp_rank, stage.pp_rank, stage, masters)
                 for tp_rank in range(reader.tp)]
        merged.append(merge_tp_shards(parts, stage, f"{reader.path} (pipeline stage "
                                                    f"{stage.pp_rank})"))
    return merge_stages(merged, cfg, str(reader.path))
