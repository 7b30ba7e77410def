"""The checkpoint manager reads checkpoints written before it existed and writes the same format.

`tests/data/checkpoint_v1` was written by `pretrain_gpt.py` at commit b8dc3d2 (before the
manager; a 1-layer, hidden-8 Llama with tied embeddings, LocalEngine, 2 steps, `--save`). The
manager plans a resume of it, restores it into a model, engine and lr schedule built from the
config, and saves that state again at once: every tensor and value of the new rank file must
equal the old one's exactly (nothing is computed in between, so no tolerance applies), and the
directory, `latest` and `metadata.json` must have the old layout. A damaged newest checkpoint
is refused when the run is planned, before any rank starts, unless `--load-fallback` asks the
loader to skip it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import pretrain_gpt
from megazpp.checkpoint.manager import CheckpointManager, LoadKind, Progress, plan_load
from megazpp.config.checks import check_config, validate_config
from megazpp.config.load import load_config
from megazpp.errors import CheckpointError
from megazpp.parallel.topology import Topology
from megazpp.training.lr_schedule import LRSchedule

FIXTURE = Path(__file__).resolve().parent / "data" / "checkpoint_v1"
RANK_FILE = "rank_tp00_pp000_dp0000.pt"
MODEL_FLAGS = [
    "--num-layers",
    "1",
    "--hidden-size",
    "8",
    "--num-attention-heads",
    "2",
    "--ffn-hidden-size",
    "16",
    "--tie-embeddings",
    "true",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "5e-3",
    "--min-lr",
    "5e-4",
    "--lr-warmup-iters",
    "1",
    "--seed",
    "3",
    "--train-iters",
    "3",
]


def assert_same(new: Any, old: Any, where: str = "state") -> None:
    """Equal structure, types and values; tensors bit for bit."""
    assert type(new) is type(old), (where, type(new), type(old))
    if isinstance(old, torch.Tensor):
        assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old), where
    elif isinstance(old, dict):
        assert list(new) == list(old), (where, list(new), list(old))
        for key in old:
            assert_same(new[key], old[key], f"{where}[{key!r}]")
    elif isinstance(old, (list, tuple)):
        assert len(new) == len(old), where
        for i, (a, b) in enumerate(zip(new, old, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert new == old, (where, new, old)


def test_checkpoint_of_the_previous_code_resumes_and_saves_the_same_format(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(FIXTURE, old)
    cfg = validate_config(load_config([*MODEL_FLAGS, "--load", str(old), "--save", str(new)]), 1)
    plan = plan_load(cfg, world_size=1)
    assert (plan.kind, plan.directory, plan.why) == (LoadKind.RESUME, str(old), f"--load {old}")

    topology, device = Topology.from_env(1, 1), torch.device("cpu")
    model = pretrain_gpt.build_model(cfg, topology, device)
    checkpoints = CheckpointManager(cfg, topology, device, plan)
    checkpoints.load_base(model)  # a full checkpoint's run has no base to load
    engine = pretrain_gpt.build_engine(model, topology, check_config(cfg, 1))
    loaded = checkpoints.load(model, engine)
    assert loaded is not None and not loaded.weights_only and loaded.path == old / "iter_0000002"
    t = cfg.training
    schedule = LRSchedule(cfg.optimizer.lr, cfg.optimizer.min_lr, t.lr_warmup_iters, t.train_iters, t.lr_decay_style)
    progress = checkpoints.restore(loaded, model, engine, schedule)
    assert progress == Progress(iteration=2, consumed_samples=8)
    assert checkpoints.start_line(loaded, progress.iteration) == f"resumed from {loaded.path} at iteration 2"

    written = torch.load(old / "iter_0000002" / RANK_FILE, map_location="cpu", weights_only=True)
    assert_same(model.state_dict(), written["model"], "model")

    saved = checkpoints.save(progress, model, engine, schedule)
    assert saved == new / "iter_0000002" and checkpoints.last == saved
    assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir()) == ["iter_0000002", "latest"]
    assert (new / "latest").read_bytes() == (old / "latest").read_bytes() == b"iter_0000002\n"
    assert sorted(p.name for p in saved.iterdir()) == ["metadata.json", RANK_FILE]
    resaved = torch.load(saved / RANK_FILE, map_location="cpu", weights_only=True)
    # the one entry added since the fixture was written: which optimizer saved the state (an old
    # checkpoint, without it, is AdamW's)
    assert resaved["engine"].pop("optimizer_name") == "adamw"
    assert_same(resaved, written)
    meta_new = json.loads((saved / "metadata.json").read_text())
    meta_old = json.loads((loaded.path / "metadata.json").read_text())
    assert list(meta_new) == list(meta_old)
    for key in ("format", "iteration", "world_size", "tp", "pp", "dp"):
        assert meta_new[key] == meta_old[key], key
    assert list(meta_new["checksums"]) == list(meta_old["checksums"]) == [RANK_FILE]
    # the model's settings as saved (a setting added later would be a new key, not a change)
    assert meta_old["model_config"].items() <= meta_new["model_config"].items()


def test_damaged_newest_checkpoint_is_refused_before_any_rank_unless_falling_back(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    (old / "iter_0000002" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        plan_load(load_config([*MODEL_FLAGS, "--load", str(old)]), world_size=1)
    # with --load-fallback the loader on the ranks skips it for an older one (or names them all)
    plan = plan_load(load_config([*MODEL_FLAGS, "--load", str(old), "--load-fallback"]), world_size=1)
    assert (plan.kind, plan.directory) == (LoadKind.RESUME, str(old))
