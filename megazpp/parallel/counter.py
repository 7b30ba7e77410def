"""Per-step and per-run byte accounting for every collective, split by link class.

Why a counter at all: the claims of ZeRO++ and PaRO are claims about bytes crossing the slow
inter-node link. Counting them where every collective passes (`comm`) turns those claims into
numbers that tests assert and TensorBoard plots.

Convention (docs/arch/parallel.md): each rank counts the bytes the backend in use puts on the
links for it (`megazpp.parallel.wire`), filed under "intra" or "inter" by the link.
"""

from __future__ import annotations

import atexit
import json
import os
from collections import defaultdict
from collections.abc import Mapping
from typing import TypedDict

LINKS = ("intra", "inter")


class Row(TypedDict):
    """One op's or one tag's bytes by link class, and its calls."""

    intra: int
    inter: int
    calls: int


class Totals(TypedDict):
    """A step's or a run's bytes by link class, with a row per op and per tag."""

    intra: int
    inter: int
    ops: dict[str, Row]
    tags: dict[str, Row]


def _row() -> Row:
    return {"intra": 0, "inter": 0, "calls": 0}


class _Totals:
    """Bytes and call counts keyed by op and by tag, plus link-class sums."""

    def __init__(self) -> None:
        self.ops: dict[str, Row] = defaultdict(_row)
        self.tags: dict[str, Row] = defaultdict(_row)

    def add(self, op: str, tag: str, intra: int, inter: int) -> None:
        for row in (self.ops[op], self.tags[tag]):
            row["intra"] += intra
            row["inter"] += inter
            row["calls"] += 1

    def as_dict(self) -> Totals:
        return {
            "intra": sum(r["intra"] for r in self.ops.values()),
            "inter": sum(r["inter"] for r in self.ops.values()),
            "ops": {k: v.copy() for k, v in sorted(self.ops.items())},
            "tags": {k: v.copy() for k, v in sorted(self.tags.items())},
        }


class CommCounter:
    """Accumulates received bytes for the current step and for the whole run.

    `step_totals()` / `run_totals()` return `Totals`:
    `{"intra": int, "inter": int, "ops": {op: {"intra", "inter", "calls"}}, "tags": {...}}`.
    """

    def __init__(self) -> None:
        self._step = _Totals()
        self._run = _Totals()
        self.steps = 0

    def record(self, op: str, tag: str, intra: int, inter: int) -> None:
        self._step.add(op, tag, intra, inter)
        self._run.add(op, tag, intra, inter)

    def step_totals(self) -> Totals:
        return self._step.as_dict()

    def run_totals(self) -> Totals:
        return self._run.as_dict()

    def reset_step(self) -> None:
        """Start a new step; the finished step stays included in the run totals."""
        self._step = _Totals()
        self.steps += 1

    def scalars(self) -> dict[str, int]:
        """This step's totals flattened to TensorBoard scalar names (`comm/inter_bytes`, ...)."""
        totals = self.step_totals()
        out = {"comm/intra_bytes": totals["intra"], "comm/inter_bytes": totals["inter"]}
        for op, row in totals["ops"].items():
            out[f"comm/{op}/intra_bytes"] = row["intra"]
            out[f"comm/{op}/inter_bytes"] = row["inter"]
        return out

    def end_step(self) -> dict[str, int]:
        """Close the current step: return its TensorBoard scalars, then start the next step."""
        scalars = self.scalars()
        self.reset_step()
        return scalars

    def write_report(self, path: str, extra: Mapping[str, object] | None = None) -> None:
        """Write this rank's run totals as JSON atomically (temp name, then rename)."""
        write_json_atomic(
            path, {"convention": CONVENTION, "steps": self.steps, "run": self.run_totals(), **(extra or {})}
        )


CONVENTION = (
    "bytes the backend's algorithm puts on the links for each rank (gloo: an equal share of "
    "each ring's hops, reduce-scatter as the all-reduce gloo runs; nccl: the logical payload "
    "from each peer), classed intra/inter by the link; world sums count every transfer once"
)


def write_json_atomic(path: str, report: Mapping[str, object]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


counter = CommCounter()

REPORT_DIR_ENV = "MEGAZPP_COMM_REPORT_DIR"


def _write_rank_report_at_exit() -> None:
    """Any process started with MEGAZPP_COMM_REPORT_DIR set leaves `comm_rank<RANK>.json`
    there when it exits (processes without RANK, i.e. launchers, write nothing), whatever
    launched it: measurements (netlab, wire checks against
    kernel counters) need the counts of a whole run without the run's code taking part."""
    directory = os.environ.get(REPORT_DIR_ENV)
    rank = os.environ.get("RANK")
    if not directory or rank is None:  # not a launched rank (e.g. the process that spawned them)
        return
    os.makedirs(directory, exist_ok=True)
    counter.write_report(
        os.path.join(directory, f"comm_rank{rank}.json"),
        extra={"rank": int(rank), "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))},
    )


atexit.register(_write_rank_report_at_exit)
