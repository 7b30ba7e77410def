"""What every command-line program shares: logging configured once, the training job's flag
names for a model's shape, `--out`, and old spellings refused with the one to use."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazpp.cli import add_out_flag, configure_logging
from megazpp.config.tool_flags import add_shape_flags, model_config
from megazpp.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def megazpp_logger():
    root = logging.getLogger("megazpp")
    handlers, level = list(root.handlers), root.level
    yield logging.getLogger("megazpp.zero.zero_engine")
    root.handlers[:], root.level = handlers, level


def test_logging_shows_info_on_rank_0_only_on_the_chosen_stream(capsys, megazpp_logger):
    configure_logging(0)
    megazpp_logger.info("zero: strategy GGG")
    assert capsys.readouterr() == ("", "zero: strategy GGG\n")
    configure_logging(1, to_stdout=True)  # replaces the earlier setting: one line per record
    megazpp_logger.info("hidden")
    megazpp_logger.warning("shown")
    assert capsys.readouterr() == ("shown\n", "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_shape_flags(
        parser,
        {
            "arch": "gpt2",
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": None,
            "micro_batch_size": 1,
        },
    )
    add_out_flag(parser)
    return parser


def test_shape_flags_take_the_training_names_and_build_the_model_config():
    args = _parser().parse_args(["--hidden-size", "128", "--seq-length", "32", "--out", "x"])
    cfg = model_config(args, vocab_size=256)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.vocab_size) == ("gpt2", 2, 128, 32, 256)
    assert (args.micro_batch_size, args.out) == (1, "x")


@pytest.mark.parametrize(
    "old,new",
    [
        ("--hidden", "--hidden-size"),
        ("--layers", "--num-layers"),
        ("--seq", "--seq-length"),
        ("--micro-batch", "--micro-batch-size"),
        ("--output", "--out"),
    ],
)
def test_old_spellings_are_refused_naming_the_new_one(old, new):
    with pytest.raises(ConfigError, match=f"^{old} is spelled {new} now"):
        _parser().parse_args([old, "8"])


def test_a_tool_refuses_an_old_spelling_in_one_line_from_the_checkout(tmp_path):
    """Run as a user would, with only the checkout on PYTHONPATH (no install needed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "plan.py"),
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--inter-gbit",
            "1",
            "--layers",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "plan.py: error: --layers is spelled --num-layers now (the name pretrain_gpt.py and every tool use)"
    )
