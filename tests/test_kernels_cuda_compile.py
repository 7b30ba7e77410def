"""Every Triton kernel variant compiles to PTX for an H100 without FMAs and with vector loads.

Runs `python -m kernels.cuda_compile_check` in a child process, because the interpreter tests
set TRITON_INTERPRET=1 for this process and interpreted kernels cannot be compiled. Needs no GPU:
Triton ships ptxas.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_kernel_variant_compiles_for_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.cuda_compile_check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    summary = re.search(r"(\d+) of (\d+) variants compiled cleanly", proc.stdout)
    assert summary and summary[1] == summary[2] and int(summary[2]) >= 20, proc.stdout


def test_a_quantizing_variant_without_the_rounding_additions_fails():
    """The check itself: PTX whose +-ROUND_MAGIC additions a compiler folded away is refused,
    for quantizing variants only (a dequantize has no rounding to keep)."""
    from kernels.cuda_compile_check import problems

    loads = "ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\n"
    rounding = "add.rn.f32 %r5, %r4, 0f4B400000;\nadd.rn.f32 %r6, %r5, 0fCB400000;\n"
    assert problems(loads + rounding, {"QMAX": 7}) == []
    assert problems(loads, {"BITS": 4}) == []
    assert problems(loads, {"QMAX": 7}) == ["lacks the rounding's add.rn.f32 of +-ROUND_MAGIC (folded or fused away)"]
    assert problems(loads + "add.rn.f32 %r5, %r4, 0f4B400000;\n", {"OUT_BITS": 4, "OUT_QMAX": 7}) != []
