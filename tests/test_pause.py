"""megazpp/pause.py: a point does nothing unless `MEGAZPP_PAUSE_AT` names it; named, the process
writes the file, waits while it exists, and pauses only once (the first arrival, or the N-th with
`POINT@N`); a malformed value is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import checkout_env, paused_at, wait_until_paused

from megazpp import pause
from megazpp.errors import ConfigError

PROGRAM = """
from megazpp.pause import pause_point
for i in range(3):
    print("before", i, flush=True)
    pause_point("evaluation")
    print("after", i, flush=True)
print("done", flush=True)
"""


def run_paused(file: Path, spec: str, lines_before: int) -> None:
    """PROGRAM armed with `spec`: paused after `lines_before` lines, then let go to its end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM],
        env=checkout_env(**paused_at(spec, file)),
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until_paused(proc, file)
    assert file.read_text() == f"{proc.pid}\n" and proc.poll() is None
    assert proc.stdout is not None
    before = [proc.stdout.readline() for _ in range(lines_before)]
    file.unlink()  # the test is done with the moment: the process goes on, and never pauses again
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = [f"{w} {i}" for i in range(3) for w in ("before", "after")] + ["done"]
    assert [x.rstrip("\n") for x in before] == lines[:lines_before]
    assert out.split("\n") == [*lines[lines_before:], ""]


def test_a_named_point_waits_while_its_file_exists(tmp_path):
    run_paused(tmp_path / "paused", "evaluation", lines_before=1)  # the first arrival
    assert list(tmp_path.iterdir()) == []


def test_a_point_armed_at_its_nth_arrival_passes_the_earlier_ones(tmp_path):
    run_paused(tmp_path / "paused", "evaluation@3", lines_before=5)  # "before 2": the third arrival
    assert list(tmp_path.iterdir()) == []


def test_unarmed_or_other_points_go_on_and_bad_values_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(pause.ENV, raising=False)
    pause.pause_point("evaluation")  # unset: returns at once
    monkeypatch.setenv(pause.ENV, f"tokenizer_reading:{tmp_path / 'f'}")
    pause.pause_point("evaluation")  # another point armed: returns at once, writes nothing
    assert list(tmp_path.iterdir()) == []
    for bad in ("evaluation", "nowhere:/tmp/x", "evaluation:", "evaluation@0:/tmp/x", "evaluation@:/tmp/x"):
        monkeypatch.setenv(pause.ENV, bad)
        with pytest.raises(ConfigError, match=r"expected POINT:FILE or POINT@N:FILE \(N >= 1\) with POINT one of"):
            pause.pause_point("evaluation")
    with pytest.raises(ValueError, match="not one of"):
        pause.pause_point("a point nobody named")


def test_rank_in_the_file_name_gives_each_rank_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv(pause.ENV, f"evaluation:{tmp_path / 'ready.{rank}'}")
    monkeypatch.setenv("RANK", "3")
    assert pause.armed("evaluation") == (tmp_path / "ready.3", 1)
    monkeypatch.delenv("RANK")
    assert pause.armed("evaluation") == (tmp_path / "ready.0", 1)  # no launcher: one process, rank 0
