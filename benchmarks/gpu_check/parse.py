"""Reading the tools' output on the GPU machine (tested on their CPU output in
tests/test_gpu_check.py): bench_quant.py's bandwidth table, bench_model.py's JSON result, the
trainer's console lines, the planner's table, a TensorBoard run's losses."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megazpp.unique_keys import JSONObject


def bandwidth_rows(markdown: str) -> list[tuple[str, float]]:
    """(op, share of copy bandwidth) from bench_quant.py's CUDA table."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[4].endswith("%") and cells[4][:-1].isdigit():
            rows.append((cells[0], int(cells[4][:-1]) / 100))
    return rows


def last_json(text: str) -> JSONObject:
    """The last line of `text` that is a JSON object (bench_model.py's result)."""
    for line in reversed(text.strip().splitlines()):
        value = json.loads(line) if line.startswith("{") else None
        if isinstance(value, dict):
            return value
    raise ValueError("no JSON result line in the output")


def log_lines(text: str) -> list[dict[str, float]]:
    """The trainer's console lines: iteration, loss, tokens/s, peak_mem (MiB) of each."""
    found = []
    for m in re.finditer(r"iter\s+(\d+)/\d+ \| loss ([\d.]+) .*?tokens/s (\d+) .*?peak_mem ([\d.]+) MiB", text):
        found.append({"iter": int(m[1]), "loss": float(m[2]), "tokens_per_s": float(m[3]), "peak_mib": float(m[4])})
    return found


def planned_peak_gib(table: str, strategy: str = "NNN") -> float:
    """The planner's predicted total GiB of `strategy` (tools/plan.py's table)."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 10 and cells[1].split()[0] == strategy:
            header = next(h for h in table.splitlines() if "total GiB" in h)
            names = [c.strip() for c in header.strip().strip("|").split("|")]
            return float(cells[names.index("total GiB")])
    raise ValueError(f"no row for {strategy} in the planner's table")


def tb_losses(directory: Path) -> list[float]:
    from megazpp.analysis.event_reader import read_run

    series = read_run(directory, directory.name).scalars["train/loss"]
    return [float(v) for v in series.values]
