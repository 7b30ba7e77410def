"""A rank killed with SIGKILL at a random (seeded) step of a 2-rank torchrun job launched by
run.sh with MAX_RESTARTS=1: torchrun restarts the job, which resumes from the latest complete
checkpoint in --save by itself, and every step's loss equals that of an uninterrupted run."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
from support import TINY_MODEL_FLAGS, run_sh_variables
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ITERS = 10


def per_step_losses(tb_dir: Path) -> dict[int, float]:
    """`train/loss` per step over all event files in write order; a restarted attempt's value
    for a step replaces the killed attempt's (they must be equal anyway)."""
    losses: dict[int, float] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*"), key=os.path.getmtime):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "train/loss":
                    losses[event.step] = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
    return losses


def launch(tmp: Path, data_dir: Path, name: str, env_extra: dict[str, str]) -> str:
    env = {**os.environ, **run_sh_variables(data_dir, 2, **env_extra)}
    args = [
        *TINY_MODEL_FLAGS,
        "--global-batch-size",
        "8",
        "--lr",
        "5e-3",
        "--min-lr",
        "5e-4",
        "--lr-warmup-iters",
        "2",
        "--train-iters",
        str(TRAIN_ITERS),
        "--eval-iters",
        "0",
        "--split",
        "90,10,0",
        "--hidden-dropout",
        "0.1",
        "--seed",
        "11",
        "--log-interval",
        "1",
        "--save",
        str(tmp / name / "ckpt"),
        "--save-interval",
        "2",
        "--tensorboard-dir",
        str(tmp / name / "tb"),
    ]
    proc = subprocess.run(
        ["bash", str(ROOT / "run.sh"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    assert proc.returncode == 0, f"{name} run failed (log: {tmp / name}.log):\n{output[-4000:]}"
    return output


@pytest.mark.slow
def test_killed_rank_restarts_and_reproduces_the_uninterrupted_losses(
    tmp_path, tiny_indexed_prefix, tiny_tokenizer_model
):
    data = tmp_path / "data"  # what run.sh expects, pointing at the shared tiny dataset
    (data / "corpus").mkdir(parents=True)
    (data / "tokenizer.model").symlink_to(tiny_tokenizer_model)
    for suffix in (".bin", ".idx"):
        (data / f"corpus_text_document{suffix}").symlink_to(f"{tiny_indexed_prefix}{suffix}")

    kill_step = random.Random(9).randint(3, TRAIN_ITERS - 1)  # seeded: the same step every run
    reference = launch(tmp_path, data, "reference", {"MAX_RESTARTS": "0"})
    faulty = launch(tmp_path, data, "faulty", {"MAX_RESTARTS": "1", "MEGAZPP_FAULT": f"kill_after_step@{kill_step}:1"})

    assert "resumed from" not in reference
    last_save = kill_step - kill_step % 2
    assert f"resumed from {tmp_path / 'faulty' / 'ckpt' / f'iter_{last_save:07d}'}" in faulty
    assert "(exitcode: -9) local_rank: 1" in faulty  # SIGKILL
    expected = per_step_losses(tmp_path / "reference" / "tb")
    assert sorted(expected) == list(range(1, TRAIN_ITERS + 1))
    assert per_step_losses(tmp_path / "faulty" / "tb") == expected
    assert (tmp_path / "faulty" / "ckpt" / "latest").read_text() == f"iter_{TRAIN_ITERS:07d}\n"
