"""megazpp/pause.py: a point does nothing unless `MEGAZPP_PAUSE_AT` names it; named, the process
writes the file, waits while it exists, and pauses only once; a malformed value is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import checkout_env, paused_at, wait_until_paused

from megazpp import pause
from megazpp.errors import ConfigError

PROGRAM = """
from megazpp.pause import pause_point
for i in range(3):
    print("before", i, flush=True)
    pause_point("evaluation")
print("done", flush=True)
"""


def test_a_named_point_waits_while_its_file_exists(tmp_path):
    file = tmp_path / "paused"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM],
        env=checkout_env(**paused_at("evaluation", file)),
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until_paused(proc, file)
    assert file.read_text() == f"{proc.pid}\n" and proc.poll() is None
    file.unlink()  # the test is done with the moment: the process goes on, and never pauses again
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split("\n") == ["before 0", "before 1", "before 2", "done", ""]
    assert list(tmp_path.iterdir()) == []


def test_unarmed_or_other_points_go_on_and_bad_values_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(pause.ENV, raising=False)
    pause.pause_point("evaluation")  # unset: returns at once
    monkeypatch.setenv(pause.ENV, f"tokenizer_reading:{tmp_path / 'f'}")
    pause.pause_point("evaluation")  # another point armed: returns at once, writes nothing
    assert list(tmp_path.iterdir()) == []
    for bad in ("evaluation", "nowhere:/tmp/x", "evaluation:"):
        monkeypatch.setenv(pause.ENV, bad)
        with pytest.raises(ConfigError, match="expected POINT:FILE with POINT one of"):
            pause.pause_point("evaluation")
    with pytest.raises(ValueError, match="not one of"):
        pause.pause_point("a point nobody named")
