"""Adapters-only checkpoints (`checkpoint.save_adapters_only`): what they leave out, and the
base their frozen weights come from.

Why: in a LoRA or partial fine-tune the frozen weights are most of the model and never change,
so writing them at every save costs disk and time for nothing. An adapters-only checkpoint
holds the trainable parameters (LoRA adapters, what `training.trainable` selects), their
engine state and the run state; the frozen weights come back from where the run took them at
its start: the imported weights-only checkpoint of `--load`, or the model's deterministic
initialisation (`model.init_seed`).

Why a digest: a base re-imported, edited or swapped under the same path would resume the
adapters on other weights and train on silently. `metadata.json` records the base (`BASE_KEY`:
the import's directory and the sha256 of its `metadata.json`, which holds every rank file's
checksum, so the digest pins every byte; or the init seed), and the start-up check refuses a
resume whose base is missing or differs, in one line, before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megazpp.checkpoint.files import file_checksum
from megazpp.checkpoint.format import METADATA_FILE, latest_checkpoint
from megazpp.errors import CheckpointError
from megazpp.unique_keys import JSONObject

BASE_KEY = "base"  # metadata.json of an adapters-only checkpoint: the base it needs


@dataclass(frozen=True)
class FrozenBase:
    """Where a run's frozen weights come from: an import (`load`: its save directory,
    `digest`: sha256 of its latest checkpoint's metadata.json) or, with `load` None, the
    model's initialisation (`digest`: "init_seed=N")."""

    load: str | None
    digest: str

    def record(self) -> dict[str, str | None]:
        return {"load": self.load, "digest": self.digest}

    def describe(self) -> str:
        if self.load is None:
            return f"the model init ({self.digest})"
        return f"the import {self.load} ({self.digest[:19]}...)"


def import_base(load_dir: str) -> FrozenBase:
    """The base of a run started from the weights-only checkpoint in `load_dir`."""
    path = latest_checkpoint(load_dir)
    if path is None:
        raise CheckpointError(f"{load_dir}: no checkpoint to take the base weights from")
    return FrozenBase(str(Path(load_dir).resolve()), file_checksum(path / METADATA_FILE))


def init_base(init_seed: int) -> FrozenBase:
    return FrozenBase(None, f"init_seed={init_seed}")


def recorded_base(path: Path, meta: JSONObject) -> FrozenBase | None:
    """The base an adapters-only checkpoint `path` records (None: a full checkpoint)."""
    saved = meta.get(BASE_KEY)
    if saved is None:
        return None
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("digest"), str)
        or not (saved.get("load") is None or isinstance(saved["load"], str))
    ):
        raise CheckpointError(
            f"{path / METADATA_FILE}: {BASE_KEY} = {saved!r} is not a base record "
            "({'load': DIR or null, 'digest': STR})"
        )
    return FrozenBase(saved["load"], saved["digest"])


def _found_base(base: FrozenBase, init_seed: int) -> str:
    """What stands where `base` should be; "" when it is there, unchanged."""
    if base.load is None:
        return "" if init_base(init_seed) == base else f"the model's init_seed is {init_seed}"
    try:
        path = latest_checkpoint(base.load)
    except CheckpointError as exc:
        return str(exc)
    if path is None:
        return f"{base.load} holds no checkpoint"
    digest = file_checksum(path / METADATA_FILE)
    return "" if digest == base.digest else f"{path / METADATA_FILE} is {digest[:19]}... (changed or another base)"


def base_refusal(path: Path, base: FrozenBase, found: str) -> CheckpointError:
    """The one-line refusal of adapters-only checkpoint `path` when its `base` is not there as
    recorded (`found`: what stands there instead)."""
    return CheckpointError(
        f"{path / METADATA_FILE}: an adapters-only checkpoint, expected its base {base.describe()}; {found}"
    )


def check_base(path: Path, base: FrozenBase, init_seed: int) -> None:
    """Refuse (naming checkpoint `path`) when `base` is missing or not what it recorded."""
    found = _found_base(base, init_seed)
    if found:
        raise base_refusal(path, base, found)


def frozen_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def without_frozen(model_state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict less its frozen parameters (buffers and trainable ones stay)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model_state.items() if k not in frozen}
