"""The model-shape and batch flags the tools share, spelled as `pretrain_gpt.py` spells them.

Why one place: bench_model, bench_strategies, calibrate_planner and plan describe a model and
its batch with the training job's words (`--num-layers`, `--hidden-size`, `--seq-length`,
`--micro-batch-size`, ...), so a command line moves between them and the job. The names come
from the config's own flag table; the spellings the tools used before are refused with these
(`megazpp.cli.add_renamed_flag`, which also gives every tool the same `--out`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from megazpp.cli import add_renamed_flag
from megazpp.config.schema import SECTIONS, flag_table
from megazpp.model.config import ModelConfig
from megazpp.setting import help_of, keys

# fields whose flags a tool may take: the model's shape and the training job's batch sizes
MODEL_FIELDS = (
    "arch",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "seq_length",
)
BATCH_FIELDS = ("micro_batch_size", "global_batch_size", "train_iters")  # the job's batches and length

# spellings the tools used before they spoke one dialect
RENAMED = {
    "--layers": "--num-layers",
    "--hidden": "--hidden-size",
    "--heads": "--num-attention-heads",
    "--query-groups": "--num-query-groups",
    "--ffn": "--ffn-hidden-size",
    "--vocab": "--vocab-size",
    "--seq": "--seq-length",
    "--micro-batch": "--micro-batch-size",
    "--global-batch": "--global-batch-size",
}


def add_shape_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, defaults: Mapping[str, Any]) -> None:
    """Add the training job's flag for each field in `defaults` (from MODEL_FIELDS and
    BATCH_FIELDS), with that default (None: not given) and the job's help line."""
    table = flag_table()
    section_of = {field: section for section, field in table.values()}
    flag_of = {field: flag for flag, (_, field) in table.items()}
    for field, default in defaults.items():
        if field not in MODEL_FIELDS + BATCH_FIELDS:
            raise ValueError(f"{field} is not a model-shape or batch field")
        flag = flag_of[field]
        help_line = next(help_of(f) for f in keys(SECTIONS[section_of[field]]) if f.name == field)
        if field == "arch":
            parser.add_argument(flag, choices=("llama", "gpt2"), default=default, help=help_line)
        else:
            parser.add_argument(flag, type=int, default=default, help=help_line)
        for old in [old for old, new in RENAMED.items() if new == flag]:
            add_renamed_flag(parser, old, flag)


def model_config(args: argparse.Namespace, **fixed: Any) -> ModelConfig:
    """The validated ModelConfig of the model-shape flags given in `args` (those left None
    take ModelConfig's defaults) and the tool's own `fixed` values."""
    given = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f, None) is not None}
    return ModelConfig(**{**given, **fixed})
