"""A two-level user's first hour, the cases that need no training run: the test suite's own
hygiene (it writes only under its temporary directories), what a streaming export holds, ...
The run.sh cases are in test_outer_run_sh.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from support import ROOT, run_sh_variables, tree_changes, tree_entries

from megazpp.outer.fragments import due_fragments, last_landed
from tests.test_first_hour import one_line_refusal, tool
from tests.test_first_hour_output import read_only_wrapper


def test_the_checkout_guard_names_what_a_test_added_or_removed(tmp_path):
    """conftest's guard (writes_only_under_temporary_directories) on a tree of its own: a run's
    new event file, a new checkpoint directory and a removed file are each named once."""
    (tmp_path / "runs" / "llama_tiny").mkdir(parents=True)
    (tmp_path / "README.md").write_text("x")
    (tmp_path / "__pycache__").mkdir()
    before = tree_entries(tmp_path)
    assert tree_changes(before, tree_entries(tmp_path)) == []
    (tmp_path / "runs" / "llama_tiny" / "events.out.tfevents.1").write_text("")
    (tmp_path / "checkpoints" / "llama_tiny" / "iter_0000012").mkdir(parents=True)
    (tmp_path / "README.md").unlink()
    (tmp_path / "__pycache__" / "x.pyc").write_text("")  # a cache: not a test's output
    assert tree_changes(before, tree_entries(tmp_path)) == [
        "+ checkpoints/",
        "+ runs/llama_tiny/events.out.tfevents.1",
        "- README.md",
    ]


def test_last_landed_sync_of_each_fragment_follows_the_schedule():
    """`last_landed` against the schedule stepped through (fragment f starts at the steps
    `due_fragments` names and lands `overlap` steps later); the issue's export: H = 10, two
    fragments, overlap 1, saved at 30 holds fragment 0's sync of 20 and fragment 1's of 25."""
    assert last_landed(30, 10, 2, 1) == [20, 25]
    assert last_landed(30, 10, 1, 0) == [30]
    for every in range(1, 7):
        for count in range(1, every + 1):
            for overlap in range(every):
                landed: list[int | None] = [None] * count
                for step in range(1, 25):
                    for f in due_fragments(step - overlap, every, count) if step - overlap >= 1 else []:
                        landed[f] = step - overlap
                    assert last_landed(step, every, count, overlap) == landed, (every, count, overlap, step)


def test_plan_offers_no_h_longer_than_the_run_and_counts_parameters_in_sensible_units(tmp_path, tiny_tokenizer_model):
    """The issue's command on the run.sh YAML (300 steps): it recommended --outer-sync-every 500,
    a run whose islands never meet, and printed "0.00 B parameters" for a model of 0.9 M (vocabulary 512 here)."""
    config = yaml.safe_load((ROOT / "configs" / "llama_tiny.yaml").read_text())
    config["data"]["tokenizer_model"] = str(tiny_tokenizer_model)  # the checkout has no data/
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    argv = ["--config", str(tmp_path / "tiny.yaml"), "--accelerator", "h100-80gb", "--nodes", "2"]
    argv += ["--gpus-per-node", "2", "--inter-gbit", "1", "--micro-batch-size", "4"]
    out = tool("tools/plan.py", *argv).stdout
    assert out.splitlines()[0].endswith(
        "vocab 512; micro-batch 4 x 1 accumulation steps, global batch 16; 4-byte weights, "
        "4-byte gradient accumulation; 918.66 K parameters"
    )
    offered = [int(h) for h in re.findall(r"DiLoCo H=(\d+) ", out)]
    assert offered and max(offered) <= 300 and "H=500" not in out
    recommended = re.search(r"--outer-sync-every (\d+) --outer-fragments \d+ --outer-overlap-steps (\d+)", out)
    assert recommended and int(recommended[1]) + int(recommended[2]) <= 300
    # --train-iters (the job's flag) shortens it further: nothing syncs within 4 steps
    short = tool("tools/plan.py", *argv, "--train-iters", "4").stdout
    assert "Two-level recommendation: none (fewer than 2 islands of whole nodes, nothing fits, or the run ends" in short


def run_sh_as(wrap: list[str], data: Path, *args: str, nproc: int = 4) -> subprocess.CompletedProcess:
    """run.sh as `run_sh` starts it, inside `wrap` (a command that runs the rest: the read-only view)."""
    env = {**os.environ, **run_sh_variables(data, nproc, MAX_RESTARTS="0")}
    return subprocess.run(
        [*wrap, "bash", str(ROOT / "run.sh"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_two_level_inputs_refused_before_any_rank(run_sh_data_dir, tmp_path):
    """Each used to fail once the ranks ran (a read-only --save at its probe, a read-only
    --tensorboard-dir as a raw OSError per rank, --outer-lr 1e300 as a traceback at the first
    sync, paro_strategy auto one missing planner setting per attempt) or to run without ever
    syncing (H longer than the run): one line from run.sh's check now, nothing started."""
    outer = ["--micro-batch-size", "4", "--ranks-per-node", "2", "--outer-algorithm", "diloco"]
    own = ["--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb")]
    refusals = {
        "--outer-sync-every 500 of 300 steps": (
            [*outer, "--outer-sync-every", "500", *own],
            "outer.sync_every = 500 with training.train_iters = 300: the first outer sync would land after step "
            "500, past the run's end, so the islands never meet and its checkpoints and exports hold the "
            "parameters it started from: give outer.sync_every <= 300 (--outer-sync-every)",
        ),
        "... and an overlapped exchange": (
            [*outer, "--outer-sync-every", "300", "--outer-overlap-steps", "1", *own],
            "the first outer sync would land after step 301",
        ),
        "--outer-lr 1e300": (
            [*outer, "--outer-lr", "1e300", *own],
            "outer.lr = 1e+300: expected a value in (0, 2.0]",
        ),
        "paro_strategy auto with islands": (
            [*outer, "--paro-strategy", "auto", *own],
            "zero.paro_strategy = auto prices the strategies on this machine's numbers: set "
            + ("" if torch.cuda.is_available() else "planner.accelerator_memory_gib, ")
            + "planner.achievable_tflops, planner.intra_node_gbs, planner.inter_node_gbit (or planner.probe = "
            "true to measure all but the memory)",
        ),
    }
    for argv, expected in refusals.values():
        one_line_refusal(run_sh_as([], run_sh_data_dir, *argv), expected)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "tb").exists()

    locked = tmp_path / "locked"
    locked.mkdir()
    wrap = read_only_wrapper(locked)
    if wrap is None:
        pytest.skip("no way to make a read-only directory here (root without unshare --mount)")
    why = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    for flag, other in (("--save", "--tensorboard-dir"), ("--tensorboard-dir", "--save")):
        argv = [*outer, "--outer-sync-every", "2", "--train-iters", "2", flag, str(locked / "out")]
        line = one_line_refusal(run_sh_as(wrap, run_sh_data_dir, *argv, other, str(tmp_path / "elsewhere")))
        assert line.endswith(
            f"{flag} {locked / 'out'} is not writable: cannot write in {locked} ({why}): give a directory this job "
            "can write"
        ), line
