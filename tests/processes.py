"""Waiting for processes that only finish together (the nodes of one multi-node run)."""

from __future__ import annotations

import subprocess


def finish_all(procs: list[subprocess.Popen], what: str, timeout_s: float) -> list[str]:
    """Each process's combined output, once all have exited 0. Every one is waited for before
    any verdict, so a node still blocked in the rendezvous is never left running: on a timeout
    all are killed."""
    outputs = []
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            raise AssertionError(f"{what} {i} did not finish within {timeout_s} s") from None
        outputs.append(out)
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"{what} {i} failed:\n{out[-4000:]}"
    return outputs
