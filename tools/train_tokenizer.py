#!/usr/bin/env python3
"""Trains a Llama-style SentencePiece BPE tokenizer (byte fallback; unk=0, bos=1, eos=2, pad=3)
on JSONL corpus files (their `text` / `raw_content`) or plain-text files. Writes PREFIX.model.
"""

from __future__ import annotations

import argparse
import time

from megazpp.cli import add_out_flag, add_progress_flag, run_tool, wants_progress
from megazpp.data.tokenizer import Tokenizer
from megazpp.preprocess.jsonl import resolve_inputs
from megazpp.preprocess.tokenizer_training import DEFAULT_INPUT_SENTENCE_SIZE, train_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip())
    parser.add_argument(
        "--input", nargs="+", required=True, help="JSONL / plain-text files, directories of JSONL files, or globs"
    )
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (default 8192)")
    add_out_flag(parser, required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--json-key", default="text", help="record key holding the document (default text)")
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=DEFAULT_INPUT_SENTENCE_SIZE,
        help=f"lines sampled for training; bounds training time (default {DEFAULT_INPUT_SENTENCE_SIZE})",
    )
    parser.add_argument("--seed", type=int, default=1234)
    add_progress_flag(parser)
    args = parser.parse_args(argv)
    files = [f for pattern in args.input for f in resolve_inputs(pattern)] if args.input else []
    start = time.perf_counter()
    print(
        f"training a SentencePiece BPE tokenizer (vocab {args.vocab_size}) on {len(files)} "
        f"files, sampling up to {args.input_sentence_size} lines",
        flush=True,
    )
    model, skipped = train_tokenizer(
        files,
        args.vocab_size,
        args.out,
        key=args.json_key,
        input_sentence_size=args.input_sentence_size,
        seed=args.seed,
        progress=wants_progress(args),
        log=lambda line: print(line, flush=True),
    )
    vocab = Tokenizer(model).vocab_size
    skipped_text = ", ".join(f"{r}={n}" for r, n in sorted(skipped.items())) or "none"
    print(
        f"tokenizer {model}: vocab {vocab} trained on {len(files)} files in "
        f"{time.perf_counter() - start:.1f} s; skipped records: {skipped_text}"
    )
    if vocab < args.vocab_size:
        print(
            f"note: --vocab-size {args.vocab_size} asked for more pieces than this corpus "
            f"yields: trained {vocab} (every merge the corpus allows); a larger corpus gives "
            "a larger vocabulary"
        )
    return 0


if __name__ == "__main__":
    run_tool(main)
