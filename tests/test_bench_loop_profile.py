"""tools/profile_loop.py: a real pretrain_gpt job under cProfile, its loop split into phases.

The phases are cumulative times of named functions inside the loop, so each is at most the
loop's time, the top-level ones (which do not nest) add up to at most the loop, and the rest
is the difference; the step count is the engine's step calls.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import data_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a child process imports torch and trains: ~15 s on a quiet machine
def test_profile_loop_splits_a_bf16_run_into_phases(tiny_indexed_prefix, tiny_tokenizer_model, tmp_path):
    flags = [
        *data_flags(str(tiny_indexed_prefix), str(tiny_tokenizer_model)),
        *"--bf16 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16".split(),
        *"--micro-batch-size 2 --global-batch-size 4 --train-iters 6 --eval-iters 0 --log-interval 3".split(),
    ]
    stats = tmp_path / "loop.prof"
    proc = subprocess.run(
        [sys.executable, "tools/profile_loop.py", "--stats", str(stats), "--", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import pstats

    from benchmarks.loop_profile import loop_profile

    profile = loop_profile(pstats.Stats(str(stats)))
    assert profile.steps == 6 and profile.loop_s > 0
    top = {k: v for k, v in profile.phases.items() if not k.startswith("  ")}
    assert {"forward + backward", "engine step (local)", "logging", "data: samples to a micro-batch"} <= set(top)
    assert abs(sum(top.values()) - profile.loop_s) <= 1e-9 * profile.loop_s + 1e-12
    assert "  of which fp32 gradient accumulation hooks" in profile.phases  # bf16: fp32 accumulation
    assert all(0 <= v <= profile.loop_s for v in profile.phases.values())
    assert "| loop (6 steps) |" in proc.stdout and "| forward + backward |" in proc.stdout
