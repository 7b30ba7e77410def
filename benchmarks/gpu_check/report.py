"""The device check's report, OUT/report.md, rewritten after every step so a cut-short run keeps
what it measured."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from benchmarks.gpu_check.commands import Outcome


def write_report(out: Path, outcomes: list[tuple[str, Outcome, float]], root: Path) -> None:
    """OUT/report.md: the device, versions and commit, each step's verdict, the targets, each step's lines."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    commit = (
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        or "unknown"
    )
    lines = [
        f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"{device}; torch {torch.__version__}, Triton {triton_version}; commit {commit}.",
        "",
        "| step | status | result | seconds |",
        "|---|---|---|---:|",
    ]
    lines += [f"| {name} | {o.status} | {o.summary} | {s:.0f} |" for name, o, s in outcomes]
    targets = [t for _, o, _ in outcomes for t in o.targets]
    if targets:
        lines += [
            "",
            "## Targets (measurements; they do not change the exit status)",
            "",
            "| target | met | value |",
            "|---|---|---:|",
        ]
        lines += [f"| {t} | {'yes' if met else 'no'} | {value} |" for t, met, value in targets]
    for name, o, _ in outcomes:
        lines += ["", f"## {name}: {o.status}", "", o.summary, "", *o.lines]
    (out / "report.md").write_text("\n".join(lines) + "\n")
