"""Atomic checkpoints under injected crashes, refusal of incomplete or inconsistent ones, and
the explicit fallback to the previous checkpoint.

Crashes are injected with `MEGAZPP_FAULT` (megazpp/faults.py): `raise_after_rank_file`
(a rank dies after writing its shard, before the others meet) and `raise_before_latest` (the
directory is complete but `latest` has not moved)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import QUIET_FLAGS
from test_training_pretrain import tiny_args

import pretrain_gpt
from megazpp.checkpoint.load import load_checkpoint
from megazpp.checkpoint.save import remove_older
from megazpp.errors import CheckpointError
from megazpp.faults import InjectedFault
from megazpp.launch.local_ranks import run_ranks


def hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def topo(dp: int = 1, dp_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(rank=dp_rank, world_size=dp, tp=1, pp=1, dp=dp, tp_rank=0, pp_rank=0, dp_rank=dp_rank)


def test_crashes_mid_save_leave_the_previous_checkpoint_untouched(
    tmp_path, monkeypatch, tiny_indexed_prefix, tiny_tokenizer_model
):
    ckpt = tmp_path / "ckpt"
    args = tiny_args(
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        *QUIET_FLAGS,
        "--save",
        str(ckpt),
        "--save-interval",
        "2",
    )
    reference = pretrain_gpt.main(
        tiny_args(
            tiny_indexed_prefix,
            tiny_tokenizer_model,
            *QUIET_FLAGS,
            "--train-iters",
            "4",
        )
    )
    pretrain_gpt.main(args + ["--train-iters", "4", "--exit-interval", "2"])
    before = hashes(ckpt / "iter_0000002")

    # 1. a crash right after this rank's shard is written: no metadata, no rename, no pointer
    monkeypatch.setenv("MEGAZPP_FAULT", "raise_after_rank_file@4")
    with pytest.raises(InjectedFault, match="raise_after_rank_file at iteration 4 on rank 0"):
        pretrain_gpt.main(args + ["--train-iters", "4"])  # resumes from ckpt (auto), crashes at 4
    assert (ckpt / "latest").read_text() == "iter_0000002\n"
    assert sorted(p.name for p in (ckpt / "iter_0000004.tmp").iterdir()) == ["rank_tp00_pp000_dp0000.pt"]
    assert not (ckpt / "iter_0000004").exists()
    assert hashes(ckpt / "iter_0000002") == before
    assert load_checkpoint(ckpt, topo()).path.name == "iter_0000002"

    # 2. a crash after the directory is complete, before `latest` moves
    monkeypatch.setenv("MEGAZPP_FAULT", "raise_before_latest@4")
    with pytest.raises(InjectedFault, match="raise_before_latest at iteration 4"):
        pretrain_gpt.main(args + ["--train-iters", "4"])
    assert (ckpt / "latest").read_text() == "iter_0000002\n"
    assert (ckpt / "iter_0000004" / "metadata.json").exists()
    assert hashes(ckpt / "iter_0000002") == before
    assert load_checkpoint(ckpt, topo()).path.name == "iter_0000002"

    # 3. the next attempt (no fault) resumes from iteration 2 and reproduces the clean run
    monkeypatch.delenv("MEGAZPP_FAULT")
    resumed = pretrain_gpt.main(args + ["--train-iters", "4"])
    assert resumed.resumed_from == 2 and sorted(resumed.losses) == [3, 4]
    assert [resumed.losses[i] for i in (3, 4)] == [reference.losses[i] for i in (3, 4)]
    assert (ckpt / "latest").read_text() == "iter_0000004\n"
    assert not list(ckpt.glob("*.tmp")) and not list(ckpt.glob("*.old"))

    # 4. the newest checkpoint rots on disk: refused, unless --load-fallback is given
    (ckpt / "iter_0000004" / "rank_tp00_pp000_dp0000.pt").write_bytes(b"\0" * 64)
    with pytest.raises(
        CheckpointError,
        match=r"dp0000.pt: checksum mismatch \(sha256:f5a5fd42d16a\.\.\., "
        r"metadata.json records sha256:[0-9a-f]{12}\.\.\.\).*\(pass --load-fallback",
    ):
        pretrain_gpt.main(args + ["--train-iters", "4"])
    # the same rot in a checkpoint that records no checksums (written before they existed)
    meta_file = ckpt / "iter_0000004" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "checksums"}))
    with pytest.raises(
        CheckpointError,
        match=r"dp0000.pt: cannot be loaded as checkpoint data "
        r"\(UnpicklingError: not tensors and plain data \(Unsupported operand 0\)\) "
        r"\(pass --load-fallback",
    ):
        pretrain_gpt.main(args + ["--train-iters", "4"])
    with pytest.warns(UserWarning, match="loading .*iter_0000002 instead"):
        fallback = pretrain_gpt.main(args + ["--train-iters", "4", "--load-fallback"])
    assert fallback.resumed_from == 2 and fallback.losses == resumed.losses


def _write(root: Path, iteration: int, layout: dict, files: dict[str, dict]) -> Path:
    """A hand-made checkpoint: `files` maps rank file names to their state."""
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    for name, state in files.items():
        torch.save(state, path / name)
    (path / "metadata.json").write_text(json.dumps({"format": 1, "iteration": iteration, **layout}))
    (root / "latest").write_text(path.name + "\n")
    return path


def test_incomplete_or_inconsistent_checkpoints_are_refused_and_fallback_is_explicit(tmp_path):
    dp2 = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2}
    good = {"iteration": 2, "model": {}, "layout": dp2}
    _write(tmp_path, 2, dp2, {"rank_tp00_pp000_dp0000.pt": good, "rank_tp00_pp000_dp0001.pt": good})
    assert load_checkpoint(tmp_path, topo(2, 1)).path.name == "iter_0000002"

    # incomplete: rank 1's file never arrived
    newest = _write(tmp_path, 4, dp2, {"rank_tp00_pp000_dp0000.pt": {**good, "iteration": 4}})
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000004: incomplete checkpoint, missing "
        r"rank files \['rank_tp00_pp000_dp0001.pt'\].*"
        r"pass --load-fallback",
    ):
        load_checkpoint(tmp_path, topo(2, 0))
    with pytest.warns(UserWarning, match="--load-fallback: loading .*iter_0000002 instead"):
        assert load_checkpoint(tmp_path, topo(2, 0), fallback=True).path.name == "iter_0000002"

    # shards disagree in step
    torch.save({**good, "iteration": 3}, newest / "rank_tp00_pp000_dp0001.pt")
    with pytest.raises(CheckpointError, match="dp0001.pt: holds iteration 3, but metadata.json says 4"):
        load_checkpoint(tmp_path, topo(2, 1))
    # a shard written under another layout
    torch.save({**good, "iteration": 4, "layout": {**dp2, "dp": 4}}, newest / "rank_tp00_pp000_dp0001.pt")
    with pytest.raises(CheckpointError, match="written under parallel layout .*'dp': 4"):
        load_checkpoint(tmp_path, topo(2, 1))
    # the run's layout differs from the checkpoint's
    with pytest.raises(CheckpointError, match="saved with parallel layout"):
        load_checkpoint(tmp_path, topo(1, 0))
    # nothing loadable even with fallback: every reason is named
    (tmp_path / "iter_0000002" / "metadata.json").write_text("{")
    with pytest.raises(
        CheckpointError,
        match="no loadable checkpoint: .*iter_0000004.*iter_0000002/metadata.json: missing or unreadable",
    ):
        load_checkpoint(tmp_path, topo(2, 1), fallback=True)
    # no `latest` at all: a fresh run, not an error
    os.remove(tmp_path / "latest")
    assert load_checkpoint(tmp_path, topo(2, 1)) is None


def _crash_between_shards(prefix: str, tokenizer: str, ckpt: str, report: str) -> None:
    """Two DP ranks save iteration 2, then rank 0 dies after writing its shard of 4."""
    import torch.distributed as dist

    args = tiny_args(
        prefix, tokenizer, "--eval-iters", "0", "--log-interval", "100", "--save", ckpt, "--save-interval", "2"
    )
    pretrain_gpt.main(args + ["--train-iters", "4", "--exit-interval", "2"])
    if dist.get_rank() == 0:
        Path(report).write_text(json.dumps(hashes(Path(ckpt) / "iter_0000002")))
    os.environ["MEGAZPP_FAULT"] = "raise_after_rank_file@4:0"
    pretrain_gpt.main(args + ["--train-iters", "4"])


def test_two_ranks_crash_between_shard_writes(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    ckpt, report = tmp_path / "ckpt", tmp_path / "hashes.json"
    with pytest.raises(RuntimeError) as failure:
        run_ranks(
            _crash_between_shards,
            2,
            str(tiny_indexed_prefix),
            str(tiny_tokenizer_model),
            str(ckpt),
            str(report),
            timeout_s=20,
        )
    text = str(failure.value)
    assert "InjectedFault: injected fault raise_after_rank_file at iteration 4 on rank 0" in text
    # rank 1 waited for rank 0 where the ranks meet after their writes, and was told which
    # operation failed
    assert "CommunicationError: all_gather_object (tag checkpoint) on rank 1 failed" in text
    assert (ckpt / "latest").read_text() == "iter_0000002\n"
    assert not (ckpt / "iter_0000004").exists() and (ckpt / "iter_0000004.tmp").is_dir()
    assert hashes(ckpt / "iter_0000002") == json.loads(report.read_text())
    for dp_rank in (0, 1):
        loaded = load_checkpoint(ckpt, topo(2, dp_rank))
        assert loaded.path.name == "iter_0000002" and loaded.state["iteration"] == 2


def test_keep_last_removes_older_checkpoints_once_a_newer_one_is_complete(
    tmp_path, tiny_indexed_prefix, tiny_tokenizer_model
):
    ckpt = tmp_path / "ckpt"
    args = tiny_args(tiny_indexed_prefix, tiny_tokenizer_model, *QUIET_FLAGS, "--save", str(ckpt))
    pretrain_gpt.main(args + ["--train-iters", "5", "--save-interval", "1", "--keep-last", "2"])
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000005"]
    assert (ckpt / "latest").read_text() == "iter_0000005\n"
    # a run continued from `latest` goes on pruning behind itself
    pretrain_gpt.main(args + ["--load", str(ckpt), "--train-iters", "7", "--save-interval", "1", "--keep-last", "2"])
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000006", "iter_0000007"]


def test_keep_last_leaves_checkpoints_above_the_new_one_and_other_files(tmp_path):
    for it in (1, 2, 3, 9):
        (tmp_path / f"iter_{it:07d}").mkdir()
    (tmp_path / "iter_0000001.tmp").mkdir()  # an unfinished save of another run: not a checkpoint
    (tmp_path / "notes.txt").write_text("mine")
    remove_older(tmp_path, 3, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001.tmp",
        "iter_0000002",
        "iter_0000003",
        "iter_0000009",
        "notes.txt",
    ]
