"""Compare training runs from their TensorBoard event files: loss curves, throughput,
inter-node bytes, and a Markdown table with the gap of every run to the first.

    python tools/compare_runs.py runs/fp32 runs/int4 runs/int4_loco --out runs/compare
    python tools/compare_runs.py runs/a runs/b --out cmp --labels baseline,zeropp --smoothing 0.6

Writes OUT/loss.png, OUT/throughput.png and OUT/summary.md; numbers are taken over the
training steps all runs share, beside each run's own last step and final loss (the notes in
summary.md say when runs differ in length or lack a tag, or when one directory holds several
runs, which are then compared separately). Tokens/s depends on the machine's load while each
run ran: the plot and the summary say so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megazpp.analysis.compare_dirs import closing_line, compare_directories
from megazpp.cli import add_out_flag, run_tool
from megazpp.errors import MegazppError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's TensorBoard directory (or a directory holding exactly one); "
        "the first run is the reference for the gap column",
    )
    add_out_flag(parser, required=True, help="directory for the PNGs and summary.md")
    parser.add_argument(
        "--smoothing",
        type=float,
        default=None,
        help="TensorBoard-style EMA weight in [0, 1) for the smoothed curves "
        "(default: adapted to the run length, up to 0.9, none for 10 "
        "points or fewer; the raw curve is always drawn)",
    )
    parser.add_argument(
        "--labels", default=None, help="comma-separated names, one per RUN_DIR (default: directory names)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    labels = args.labels.split(",") if args.labels is not None else None
    try:
        files = compare_directories(args.run_dirs, args.out, smoothing=args.smoothing, labels=labels)
    except MegazppError as exc:
        print(f"compare_runs.py: error: {exc}", file=sys.stderr)
        return 2
    print(closing_line(files))
    return 0


if __name__ == "__main__":
    run_tool(main)
