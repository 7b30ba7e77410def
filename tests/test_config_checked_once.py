"""Checked once, truly: `check_config` is pure, and the ranks take the job check's decision.

`run.sh`'s check (`startup.main --handoff FILE`) decides the run once per node; its ranks read
FILE (`startup.read_handoff`) and must not run a check again, or load the config themselves.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from support import TINY_MODEL_FLAGS, checkout_env, data_flags

from megazpp.config import checks
from megazpp.config.checks import check_config
from megazpp.config.load import load_config
from megazpp.errors import ConfigError
from megazpp.training import startup
from megazpp.zero.options import ZeroOptions


def test_check_config_returns_what_it_resolved_and_leaves_its_input():
    cfg = load_config(
        [*TINY_MODEL_FLAGS, "--micro-batch-size", "2", "--gradient-accumulation-steps", "3"]
        + ["--train-iters", "20", "--lr-warmup-fraction", "0.25"]
    )
    before = cfg.to_dict()
    run = check_config(cfg, world_size=2)
    assert cfg.to_dict() == before  # nothing written into the loader's config
    assert (cfg.training.global_batch_size, cfg.training.lr_warmup_iters) == (None, 0)
    t = run.config.training
    assert (t.global_batch_size, t.lr_warmup_iters, t.lr_warmup_fraction) == (12, 5, None)
    assert (run.global_batch_size, run.micro_batches, run.zero.micro_batches_per_step) == (12, 3, 3)
    assert run.uses_zero_engine  # two data-parallel ranks
    again = check_config(run.config, world_size=2)  # the resolved config checks to itself
    assert again == run


def _job(data_prefix: str, tokenizer: str) -> list[str]:
    return [*TINY_MODEL_FLAGS, *data_flags(data_prefix, tokenizer), "--micro-batch-size", "2", "--train-iters", "2"]


def test_a_rank_takes_the_job_checks_decision_and_checks_nothing(
    tmp_path, monkeypatch, tiny_indexed_prefix, tiny_tokenizer_model
):
    argv = _job(tiny_indexed_prefix, str(tiny_tokenizer_model))
    handoff = tmp_path / "checked"
    check = [sys.executable, "-m", "megazpp.training.startup", "--world-size", "2", "--ranks-on-node", "2"]
    done = subprocess.run(
        [*check, "--node-rank", "0", "--handoff", str(handoff), *argv],
        env=checkout_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and handoff.exists(), done.stderr  # run.sh's check, as run.sh runs it
    monkeypatch.setenv(startup.HANDOFF_ENV, str(handoff))

    def checked_again(*_: object, **__: object) -> None:
        raise AssertionError("a rank checked the run again")

    monkeypatch.setattr(checks, "check_config", checked_again)
    monkeypatch.setattr(startup, "check_config", checked_again)
    monkeypatch.setattr(startup, "load_config", checked_again)
    monkeypatch.setattr(ZeroOptions, "__post_init__", checked_again)
    start = startup.read_handoff(argv, 2)
    assert start is not None
    assert start.options.global_batch_size == 4 and start.options.zero.micro_batches_per_step == 1
    assert start.cfg is start.options.config
    assert startup.replan(start, 2, restarts=0, ranks_on_node=2) is start  # a first attempt keeps the job's plan
    with pytest.raises(ConfigError, match="was checked for 2 rank\\(s\\) and other arguments"):
        startup.read_handoff([*argv, "--train-iters", "3"], 2)
    with pytest.raises(ConfigError, match="unset MEGAZPP_CHECKED_RUN"):
        startup.read_handoff(argv, 4)


def test_a_restarted_attempt_decides_its_load_plan_again(
    tmp_path, monkeypatch, tiny_indexed_prefix, tiny_tokenizer_model
):
    argv = _job(tiny_indexed_prefix, str(tiny_tokenizer_model)) + ["--save", str(tmp_path / "ckpt")]
    start = startup.prepare(argv, 1, ranks_on_node=1)
    planned: list[tuple[int, int]] = []

    def plan_load(cfg: object, world_size: int, restarts: int, ranks_per_node: int) -> object:
        planned.append((restarts, ranks_per_node))
        return start.load

    monkeypatch.setattr(startup, "plan_load", plan_load)
    # the node's rank count goes with it: a two-level checkpoint's islands are whole nodes
    # (without it a restarted 3-node job of 3 islands counted 1 and refused its own checkpoint)
    again = startup.replan(start, 1, restarts=1, ranks_on_node=2)
    assert planned == [(1, 2)] and again.options is start.options
    assert dataclasses.replace(again, load=start.load) == start
