#!/usr/bin/env python3
"""Builds the embedded default corpus (RedPajama v1 JSONL) from this Python's standard library.

Usage: python tools/make_sample_corpus.py --out DIR [--total-bytes N]
"""

from __future__ import annotations

import argparse
import time

from megazpp.cli import add_out_flag, add_progress_flag, run_tool, wants_progress
from megazpp.preprocess.sample_corpus import DEFAULT_TOTAL_BYTES, build_sample_corpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_flag(parser, required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--total-bytes",
        type=int,
        default=DEFAULT_TOTAL_BYTES,
        help=f"approximate corpus size in bytes (default {DEFAULT_TOTAL_BYTES})",
    )
    add_progress_flag(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    summary = build_sample_corpus(args.out, total_bytes=args.total_bytes, progress=wants_progress(args))
    for source, path in summary.files.items():
        print(f"{path}: {summary.documents[source]} documents, {summary.bytes[source]} bytes")
    print(
        f"sample corpus: {len(summary.files)} sources, {sum(summary.documents.values())} documents, "
        f"{sum(summary.bytes.values())} bytes in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    run_tool(main)
