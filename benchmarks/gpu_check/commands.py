"""Running the device check's commands: each one's output in OUT/logs/NAME.log, a timeout that
kills its process group, the time budget left, and a step's verdict (`Outcome`)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Outcome:
    """A step's verdict: 'ok', 'MISMATCH', 'FAILED' (a command), 'skipped'; its report lines."""

    status: str
    summary: str
    lines: list[str] = field(default_factory=list)
    targets: list[tuple[str, bool, str]] = field(default_factory=list)  # (target, met, value)


@dataclass
class Context:
    """Where the check writes (`out`), the checkout it runs in (`root`), and when its budget ends."""

    out: Path
    deadline: float
    root: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(self.root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(extra)
        return env

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Job:
    """A started command, its output going to OUT/logs/NAME.log."""

    proc: subprocess.Popen[str]
    log: Path
    timeout: float

    def collect(self) -> tuple[int, str]:
        """(exit status, output); 124 when it ran past its timeout (its process group killed)."""
        try:
            rc = self.proc.wait(timeout=max(1.0, self.timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            rc = 124
        return rc, self.log.read_text()


def start(ctx: Context, name: str, cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> Job:
    log = ctx.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        proc = subprocess.Popen(
            list(cmd),
            cwd=ctx.root,
            env=env or ctx.env(),
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    return Job(proc, log, timeout)


def run(
    ctx: Context, name: str, cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    return start(ctx, name, cmd, timeout, env).collect()


def tail(text: str, n: int = 15) -> list[str]:
    return ["```", *text.strip().splitlines()[-n:], "```"]


def run_sh(
    ctx: Context, name: str, flags: list[str], *, ranks: int, gpu: bool, timeout: float, save: Path | None = None
) -> Job:
    """`bash run.sh FLAGS` on `ranks` ranks of this node, on the GPU or (CUDA hidden) on CPU
    ranks, data under OUT/data, TensorBoard under OUT/tb/NAME, checkpoints in `save` (none
    without it)."""
    env = ctx.env(DATA_DIR=str(ctx.out / "data"), NPROC_PER_NODE=str(ranks))
    if ranks > 1:  # eight jobs share the machine's cores (run.sh sets 1 for CPU ranks itself)
        env["OMP_NUM_THREADS"] = "1"
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = ["bash", "run.sh", *flags, "--tensorboard-dir", str(ctx.out / "tb" / name), "--save", str(save or "none")]
    return start(ctx, name, cmd, timeout, env)
