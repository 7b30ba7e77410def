"""A two-level user's first hour, the cases that need no training run: the test suite's own
hygiene (it writes only under its temporary directories), what a streaming export holds, ...
The run.sh cases are in test_outer_run_sh.py."""

from __future__ import annotations

from support import tree_changes, tree_entries

from megazpp.outer.fragments import due_fragments, last_landed


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
