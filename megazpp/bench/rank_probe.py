"""Run a training script as one launched rank and record that rank's peak memory on exit.

    python -m torch.distributed.run ... -m megazpp.bench.rank_probe --out DIR SCRIPT [ARGS...]

Why a wrapper: the trainer logs the peak RSS of its logging rank only, and a launcher's
RUSAGE_CHILDREN keeps the largest child over its whole life, so neither gives every rank's
peak. Running the script in this process (runpy, as `python SCRIPT` would) and reading
RUSAGE_SELF when it returns, however it returns, does; the script's code is untouched.
Writes DIR/rss_rank<RANK>.json: {"rank", "maxrss_bytes", "exit"}.
"""

from __future__ import annotations

import argparse
import os
import resource
import runpy
import sys
from typing import Sequence

from megazpp.parallel.counter import write_json_atomic


def probe_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rss_rank{rank}.json")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for rss_rank<RANK>.json")
    parser.add_argument("script", help="the Python script to run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    ns = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
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
        write_json_atomic(probe_path(ns.out, rank), {
            "rank": rank,
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "exit": status})


if __name__ == "__main__":
    main()
