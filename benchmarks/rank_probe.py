"""Run a training script as one launched rank; record its peak memory and collective calls.

    python -m torch.distributed.run ... -m benchmarks.rank_probe --out DIR SCRIPT [ARGS...]

Why a wrapper: the trainer logs the peak RSS of its logging rank only, and a launcher's
RUSAGE_CHILDREN keeps the largest child over its whole life, so neither gives every rank's
peak. Running the script in this process (runpy, as `python SCRIPT` would) and reading
RUSAGE_SELF when it returns, however it returns, does; the script's code is untouched.

Collective calls: on CPU ranks every call costs a fixed host time, so the benchmark reports
calls per step for megazpp and DeepSpeed alike. megazpp's own counter sees only its `comm`
layer and DeepSpeed bypasses it, so the probe counts at the one place both pass: every
torch.distributed collective and point-to-point function (a call made inside another, such
as all_gather_object's, counts once), and notes the running count whenever an optimizer
step ends (torch's global optimizer step hooks; an optimizer stepped inside another's step, as
DeepSpeed's ZeRO optimizer steps the client AdamW, is the same training step).
Writes DIR/rss_rank<RANK>.json: {"rank", "maxrss_bytes", "exit", "calls_at_steps"}.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from megazpp.parallel.counter import write_json_atomic

COUNTED_FUNCTIONS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "_broadcast_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
)

P = ParamSpec("P")
R = TypeVar("R")


class CallCounter:
    """Counts outermost torch.distributed calls; `at_steps[i]` = calls when step i + 1 ended."""

    def __init__(self) -> None:
        self.calls = 0
        self.at_steps: list[int] = []
        self._depth = 0
        self._stepping = 0  # optimizer steps in progress: DeepSpeed's ZeRO optimizer steps the client's inside its own

    def _wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        def counted(*args: P.args, **kwargs: P.kwargs) -> R:
            if self._depth == 0:
                self.calls += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return functools.wraps(fn)(counted)

    def install(self) -> None:
        """Wrap the functions in torch.distributed and in distributed_c10d (where they call each
        other), before the script imports anything that might keep its own reference."""
        for name in COUNTED_FUNCTIONS:
            fn = getattr(distributed_c10d, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(fn)
            setattr(distributed_c10d, name, wrapped)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, wrapped)
        register_optimizer_step_pre_hook(self._step_starts)
        register_optimizer_step_post_hook(self._step_ends)

    def _step_starts(self, *_: object) -> None:
        self._stepping += 1

    def _step_ends(self, *_: object) -> None:
        self._stepping -= 1
        if self._stepping == 0:  # the outermost step of this training step
            self.at_steps.append(self.calls)


def probe_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rss_rank{rank}.json")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for rss_rank<RANK>.json")
    parser.add_argument("script", help="the Python script to run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    ns = parser.parse_args(argv)
    # a launcher per replica group (the torchft peer) numbers its ranks from 0: the base makes them global
    rank = int(os.environ.get("RANK", "0")) + int(os.environ.get("MEGAZPP_PROBE_RANK_BASE", "0"))
    calls = CallCounter()
    calls.install()
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    status: int | str = 0
    try:
        runpy.run_path(ns.script, run_name="__main__")
    except SystemExit as exc:
        status = exc.code if exc.code is not None else 0
        raise
    except BaseException as exc:
        status = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        os.makedirs(ns.out, exist_ok=True)
        write_json_atomic(
            probe_path(ns.out, rank),
            {
                "rank": rank,
                "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
                "exit": status,
                "calls_at_steps": calls.at_steps,
            },
        )


if __name__ == "__main__":
    main()
