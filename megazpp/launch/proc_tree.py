"""Processes by parent, from /proc (Linux).

Why: torchrun starts every rank in a session of its own, so neither a process group nor a
terminal's signal reaches them from the launcher; who is below whom is read from each
process's parent pid instead (the launcher forwarding a signal to its ranks, a benchmark
killing an island's whole tree, a test finding a launcher's ranks).
"""

from __future__ import annotations

import os
from pathlib import Path


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's pid under its parent's pid (one that exits meanwhile is left out)."""
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited meanwhile
            continue
        found.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return found


def child_pids(pid: int) -> list[int]:
    return children_by_parent().get(pid, [])


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children, tree, todo = children_by_parent(), [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree
