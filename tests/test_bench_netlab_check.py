"""tools/bench_netlab_check.py: the planner's predicted step time of tools/bench_netlab.py's
two-level rows against the measured one (issue 28's out-of-sample check), end to end on
loopback with a tiny model. Timing is not asserted (a loaded machine): the rows printed are the
results file's two-level rows, the measured column is the file's numbers and each error is
computed from the printed predicted and measured values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--hidden-size", "32", "--num-layers", "4", "--num-attention-heads", "4", "--num-query-groups", "2"]
MEASURED = {"diloco-h20-bf16": 0.25, "diloco-h20-bf16-stream": 0.5}


def _results(tmp_path: Path, data_dir: Path, rows: list[dict]) -> Path:
    command = (
        f"python tools/bench_netlab.py --rates loopback --steps 40 --warmup 20 --data-dir {data_dir} "
        f"-- {' '.join(TINY)}"
    )
    path = tmp_path / "loopback.json"
    path.write_text(json.dumps({"command": command, "rows": rows, "setting": "loopback"}))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/bench_netlab_check.py", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_check_refuses_results_without_two_level_rows(tmp_path):
    path = _results(tmp_path, tmp_path, [{"config": "zero3", "status": "ok", "step_time_s": 1.0}])
    proc = _run("--local", str(path))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{path}: no two-level row measured ok" in lines[0], proc.stderr


@pytest.mark.slow
def test_check_prints_each_two_level_row_against_the_results(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    data = tmp_path / "data"  # the layout tools/bench_netlab.py reads (its --data-dir)
    data.mkdir()
    (data / "tokenizer.model").symlink_to(tiny_tokenizer_model)
    for ext in ("bin", "idx"):
        (data / f"corpus_text_document.{ext}").symlink_to(f"{tiny_indexed_prefix}.{ext}")
    rows = [
        {"config": "zero3", "runner": "megazpp", "status": "ok", "step_time_s": 1.0},
        {"config": "torchft-diloco-h20", "runner": "torchft", "status": "ok", "step_time_s": 1.0},
        {"config": "diloco-h20-bf16", "status": "ok", "step_time_s": MEASURED["diloco-h20-bf16"]},
        {"config": "diloco-h20-int4", "status": "failed: timeout", "step_time_s": None},
        {"config": "diloco-h20-bf16-stream", "status": "ok", "step_time_s": MEASURED["diloco-h20-bf16-stream"]},
    ]
    proc = _run("--local", str(_results(tmp_path, data, rows)), "--rounds", "1", "--breakdown")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(
        r"^Llama 4 layers, hidden 32, .*loopback\.json \(setting loopback\).*2 nodes x 2 ranks", proc.stdout, re.M
    )
    table = re.findall(r"^\| (diloco-[\w-]+) \| ([0-9.]+) \| ([0-9.]+) \| ([-+][0-9.]+) % \|$", proc.stdout, re.M)
    assert [r[0] for r in table] == list(MEASURED)
    errors = []
    for name, predicted, measured, error in table:
        assert float(measured) == MEASURED[name] and float(predicted) > 0
        errors.append(float(predicted) / float(measured) - 1)
        assert abs(float(error) - 100 * errors[-1]) < 0.1  # the table's rounding (4 digits of seconds, 1 of percent)
    worst = re.search(r"^largest error ([0-9.]+) % \(target <= 15 %\): (PASS|FAIL)$", proc.stdout, re.M)
    assert worst and abs(float(worst.group(1)) - 100 * max(map(abs, errors))) < 0.2
    assert "not checked: zero3 (synchronous: tools/calibrate_planner.py checks those)" in proc.stdout
    assert "torchft-diloco-h20 (a peer)" in proc.stdout and "diloco-h20-int4 (failed: timeout)" in proc.stdout
    assert re.search(r"^  diloco-h20-bf16: compute=[0-9.]+ .*", proc.stdout, re.M)
