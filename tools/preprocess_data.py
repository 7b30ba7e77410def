#!/usr/bin/env python3
"""Tokenizes RedPajama-style JSONL (.jsonl / .jsonl.gz, v1 `text` or v2 `raw_content`) into
Megatron's indexed-dataset layout: <output-prefix>_<key>_document.bin/.idx.

Malformed lines, records without the key, non-UTF-8 bytes and empty documents are skipped and
counted by reason in the closing summary line.
"""

from __future__ import annotations

import argparse

from megazpp.cli import add_progress_flag, run_tool, wants_progress
from megazpp.data.preprocess import DEFAULT_CHUNK_BYTES, preprocess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a JSONL file, a directory of them, or a glob (quote it)")
    parser.add_argument("--tokenizer-model", required=True, help="SentencePiece .model file")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="record keys to tokenize, one dataset each (default: text; "
                             "`text` also reads RedPajama v2's raw_content)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help=f"input bytes per unit of worker work (default {DEFAULT_CHUNK_BYTES})")
    add_progress_flag(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    summary = preprocess(args.input, args.tokenizer_model, args.output_prefix, workers=args.workers,
                         json_keys=tuple(args.json_keys), append_eod=args.append_eod,
                         chunk_bytes=args.chunk_bytes, progress=wants_progress(args))
    for key, prefix in summary.outputs.items():
        print(f"{prefix}.bin/.idx: {summary.documents[key]} documents, {summary.tokens[key]} tokens")
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_tool(main)
