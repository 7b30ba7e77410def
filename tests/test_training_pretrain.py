"""pretrain_gpt.py end to end, in process, on the tiny shared corpus: TensorBoard tags,
falling loss, bitwise checkpoint resume, and the checkpoint files' atomic layout."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from support import TINY_MODEL_FLAGS, data_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megazpp.checkpoint.format import latest_checkpoint
from megazpp.errors import CheckpointError
from megazpp.training.logger import TAGS


def tiny_args(prefix, tokenizer, *extra: str) -> list[str]:
    return [
        *data_flags(prefix, tokenizer),
        *TINY_MODEL_FLAGS,
        "--global-batch-size",
        "4",
        "--lr",
        "5e-3",
        "--min-lr",
        "5e-4",
        "--lr-warmup-iters",
        "2",
        "--eval-iters",
        "2",
        "--seed",
        "3",
        *extra,
    ]


@pytest.mark.slow
def test_pretrain_writes_tensorboard_and_loss_falls(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model, capsys):
    tb = tmp_path / "tb"
    history = pretrain_gpt.main(
        tiny_args(
            tiny_indexed_prefix,
            tiny_tokenizer_model,
            "--train-iters",
            "30",
            "--log-interval",
            "5",
            "--eval-interval",
            "10",
            "--tensorboard-dir",
            str(tb),
        )
    )
    losses = [history.losses[i] for i in range(1, 31)]
    assert losses[0] == pytest.approx(math.log(512), abs=0.3)  # untrained: ~uniform over vocab
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert sorted(history.val_losses) == [10, 20, 30]

    events = EventAccumulator(str(tb))
    events.Reload()
    assert set(TAGS) <= set(events.Tags()["scalars"])
    train_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(train_loss) == [1, 5, 10, 15, 20, 25, 30]
    assert train_loss[1] == pytest.approx(losses[0], rel=1e-6)
    assert train_loss[10] == pytest.approx(sum(losses[5:10]) / 5, rel=1e-6)
    val = {e.step: e.value for e in events.Scalars("val/loss")}
    assert val == pytest.approx(history.val_losses, rel=1e-6)
    assert all(e.value == 1.0 for e in events.Scalars("train/loss_scale"))
    assert all(
        e.value > 0
        for tag in ("perf/tokens_per_sec", "perf/tflops", "mem/peak_bytes", "train/grad_norm", "train/lr")
        for e in events.Scalars(tag)
    )
    assert {"config/text_summary", "_hparams_/session_start_info"} <= set(events.Tags()["tensors"])
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "hidden_size: 32" in config_text and "vocab_size: 512" in config_text

    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter")]
    line10 = next(line for line in console if line.startswith("iter     10/30 | loss"))
    assert f"loss {train_loss[10]:.4f}" in line10


def test_resume_is_bitwise_identical(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    # Dropout on, evaluation and a save in the middle: resuming must restore the RNG streams,
    # optimizer moments, lr schedule and sampler position exactly.
    common = tiny_args(
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        "--train-iters",
        "8",
        "--hidden-dropout",
        "0.1",
        "--eval-interval",
        "3",
        "--log-interval",
        "100",
    )
    full = pretrain_gpt.main(common)
    ckpt = tmp_path / "ckpt"
    first = pretrain_gpt.main(common + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval", "5"])
    assert sorted(first.losses) == [1, 2, 3, 4, 5]
    assert latest_checkpoint(ckpt).name == "iter_0000005"
    assert (ckpt / "latest").read_text() == "iter_0000005\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000005", "latest"]
    meta = json.loads((ckpt / "iter_0000005" / "metadata.json").read_text())
    assert meta.pop("model_config")["hidden_size"] == 32
    assert meta.pop("config")["training"]["train_iters"] == 8  # the resolved config, whole
    rank_file = ckpt / "iter_0000005" / "rank_tp00_pp000_dp0000.pt"  # hashed while written
    assert meta.pop("checksums") == {rank_file.name: "sha256:" + hashlib.sha256(rank_file.read_bytes()).hexdigest()}
    assert meta == {"format": 1, "iteration": 5, "world_size": 1, "tp": 1, "pp": 1, "dp": 1}

    second = pretrain_gpt.main(common + ["--load", str(ckpt), "--save", str(ckpt)])
    assert second.resumed_from == 5 and sorted(second.losses) == [6, 7, 8]
    for i in range(1, 6):
        assert first.losses[i] == full.losses[i], i
    for i in range(6, 9):
        assert second.losses[i] == full.losses[i], i
    assert second.val_losses == {k: v for k, v in full.val_losses.items() if k > 5}
    assert latest_checkpoint(ckpt).name == "iter_0000008"


def test_broken_checkpoints_are_refused(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    ckpt = tmp_path / "ckpt"
    args = tiny_args(
        tiny_indexed_prefix, tiny_tokenizer_model, "--train-iters", "2", "--eval-iters", "0", "--save", str(ckpt)
    )
    pretrain_gpt.main(args)
    state = torch.load(ckpt / "iter_0000002" / "rank_tp00_pp000_dp0000.pt", weights_only=True)
    assert state["iteration"] == 2 and state["consumed_samples"] == 8
    assert not list(ckpt.glob("*.tmp")) and not list(ckpt.rglob("*.partial"))

    resume = args + ["--load", str(ckpt), "--train-iters", "3"]
    (ckpt / "latest").write_text("iter_0000009\n")
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000009: checkpoint named by .*latest is "
        r"missing or incomplete",
    ):
        pretrain_gpt.main(resume)
    (ckpt / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="expected a checkpoint name like 'iter_0000100'"):
        pretrain_gpt.main(resume)
    (ckpt / "latest").write_text("iter_0000002\n")
    (ckpt / "iter_0000002" / "rank_tp00_pp000_dp0000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="rank_tp00_pp000_dp0000.pt: checksum mismatch"):
        pretrain_gpt.main(resume)
    meta_file = ckpt / "iter_0000002" / "metadata.json"  # as written before checksums existed
    meta_file.write_text(json.dumps({k: v for k, v in json.loads(meta_file.read_text()).items() if k != "checksums"}))
    with pytest.raises(CheckpointError, match="rank_tp00_pp000_dp0000.pt: cannot be loaded"):
        pretrain_gpt.main(resume)
