"""The three conversions the command-line tools run, as functions (tests call them too).

- `import_hf`: Hugging Face Llama directory -> weights-only megazpp checkpoint, any tp x pp.
- `export_hf`: megazpp checkpoint (any tp x pp) -> Hugging Face Llama directory.
- `export_safetensors`: megazpp checkpoint -> one safetensors file of full weights under
  megazpp's own names, with the model config in the file's metadata.

Both exports write a plain model: LoRA adapters are merged into their base weights
(W + alpha / r B A) and the exported config has no adapters.

A SentencePiece `tokenizer.model` travels along when given (or, on import, when the HF
directory has one): it is checked against the model first, then copied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from megazpp.checkpoint.reader import CheckpointReader
from megazpp.errors import CheckpointError, refuse_existing
from megazpp.interop.checkpoint_io import write_weights_checkpoint
from megazpp.interop.consolidate import cast, consolidated_weights
from megazpp.interop.hf_llama import hf_config_from_model, hf_to_megazpp, megazpp_to_hf, model_config_from_hf
from megazpp.interop.safetensors_io import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    WeightFiles,
    read_json,
    write_hf_weights,
    write_json,
    write_safetensors,
)
from megazpp.interop.tokenizer_check import check_tokenizer
from megazpp.model.config import ModelConfig
from megazpp.model.lora import merge_adapters

TOKENIZER_FILE = "tokenizer.model"
SAFETENSORS_CONFIG_KEY = "megazpp_model_config"


def _copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".partial")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def import_hf(
    hf_dir: str | os.PathLike[str],
    save_dir: str | os.PathLike[str],
    *,
    tp: int = 1,
    pp: int = 1,
    seq_length: int | None = None,
    dtype: torch.dtype | None = None,
    tokenizer_model: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert; return the written checkpoint directory (`save_dir/iter_0000000`)."""
    hf_dir = Path(hf_dir)
    hf_config = read_json(hf_dir / CONFIG_FILE)
    cfg = model_config_from_hf(hf_config, seq_length=seq_length, where=str(hf_dir / CONFIG_FILE))
    tokenizer = Path(tokenizer_model) if tokenizer_model else hf_dir / TOKENIZER_FILE
    if tokenizer_model or tokenizer.exists():
        check_tokenizer(tokenizer, cfg.vocab_size, hf_config)
    full = cast(hf_to_megazpp(WeightFiles(hf_dir), cfg, where=str(hf_dir)), dtype)
    path = write_weights_checkpoint(save_dir, cfg, full, tp, pp, {"source": f"Hugging Face Llama {hf_dir.resolve()}"})
    if tokenizer.exists():
        _copy_file(tokenizer, Path(save_dir) / TOKENIZER_FILE)
    return path


def _full_weights(
    load: str | os.PathLike[str], cfg: ModelConfig | None, masters: bool, dtype: torch.dtype | None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = CheckpointReader(load)
    model_cfg = reader.model_config(cfg)
    full = consolidated_weights(reader, model_cfg, masters=masters)
    if model_cfg.lora_rank:  # exports are plain models: adapters folded into their weights
        full = merge_adapters(full, model_cfg)
        model_cfg = dataclasses.replace(model_cfg, lora_rank=0, lora_targets=None)
    return model_cfg, cast(full, dtype)


def export_hf(
    load: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    cfg: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    masters: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_model: str | os.PathLike[str] | None = None,
) -> Path:
    """Write config.json + safetensors weights (+ tokenizer.model) into `out_dir`."""
    out = Path(out_dir)
    refuse_existing(
        out / CONFIG_FILE, CheckpointError, found="already exists (a model)", instead="choose a new directory"
    )
    model_cfg, full = _full_weights(load, cfg, masters, dtype)
    hf_weights = megazpp_to_hf(full, model_cfg)
    if tokenizer_model:
        check_tokenizer(tokenizer_model, model_cfg.vocab_size)
    saved_dtype = next(iter(hf_weights.values())).dtype
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(out, hf_weights, max_shard_bytes)
    if tokenizer_model:
        _copy_file(Path(tokenizer_model), out / TOKENIZER_FILE)
    # config.json last: its presence marks a complete export
    write_json(out / CONFIG_FILE, hf_config_from_model(model_cfg, saved_dtype))
    return out


def export_safetensors(
    load: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    cfg: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    masters: bool = False,
) -> Path:
    """One safetensors file of full weights, megazpp names, model config in its metadata."""
    out = Path(output)
    refuse_existing(out, CheckpointError, instead="choose a new file")
    model_cfg, full = _full_weights(load, cfg, masters, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, full, {"format": "pt", SAFETENSORS_CONFIG_KEY: json.dumps(dataclasses.asdict(model_cfg))})
    return out
