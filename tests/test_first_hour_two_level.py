"""A two-level user's first hour, the cases that need no training run: the test suite's own
hygiene (it writes only under its temporary directories), what a streaming export holds, ...
The run.sh cases are in test_outer_run_sh.py."""

from __future__ import annotations

import re

import yaml
from support import ROOT, tree_changes, tree_entries

from megazpp.outer.fragments import due_fragments, last_landed
from tests.test_first_hour import tool


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
