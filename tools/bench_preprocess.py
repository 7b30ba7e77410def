#!/usr/bin/env python3
"""Benchmarks tools/preprocess_data.py: tokens/s with 1 and 2 (or more) workers on the sample
corpus, against the single-process SentencePiece encode rate (the per-core ceiling).
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from megazpp.cli import run_tool
from megazpp.data.jsonl import (
    SkipReason,
    extract_text,
    iter_line_chunks,
    resolve_inputs,
)
from megazpp.data.preprocess import preprocess
from megazpp.data.sample_corpus import DEFAULT_TOTAL_BYTES, build_sample_corpus
from megazpp.data.tokenizer import Tokenizer
from megazpp.data.tokenizer_training import train_tokenizer


def encode_ceiling(corpus: str, model: Path) -> tuple[int, float]:
    """(tokens, seconds) of one process encoding every document, with no I/O or JSON in the timing."""
    texts = [t for path in resolve_inputs(corpus) for chunk in iter_line_chunks(path, 1 << 22)
             for t in (extract_text(line, "text") for line in chunk) if not isinstance(t, SkipReason)]
    tok = Tokenizer(model)
    start = time.perf_counter()
    ids = tok.encode_batch(texts)
    seconds = time.perf_counter() - start
    return sum(map(len, ids)), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", help="JSONL file/dir/glob (default: build the sample corpus in a temp dir)")
    parser.add_argument("--total-bytes", type=int, default=DEFAULT_TOTAL_BYTES,
                        help="size of the sample corpus when --corpus is not given")
    parser.add_argument("--tokenizer-model", help="SentencePiece model (default: train one on the corpus)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocab of the trained tokenizer (default 8192)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time (default 1 2)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per setting; the best is reported (default 3)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        corpus = args.corpus
        if corpus is None:
            corpus = str(Path(tmp) / "corpus")
            build_sample_corpus(corpus, total_bytes=args.total_bytes)
        model = Path(args.tokenizer_model) if args.tokenizer_model else \
            train_tokenizer(resolve_inputs(corpus), args.vocab_size, Path(tmp) / "tok")[0]
        corpus_bytes = sum(p.stat().st_size for p in resolve_inputs(corpus))
        vocab = Tokenizer(model).vocab_size
        runs = []
        tokens, seconds = min((encode_ceiling(corpus, model) for _ in range(args.repeat)), key=lambda r: r[1])
        ceiling = tokens / seconds
        for workers in args.workers:
            best = min((preprocess(corpus, model, Path(tmp) / f"out{workers}", workers=workers, progress=False)
                        for _ in range(args.repeat)), key=lambda s: s.seconds)
            runs.append({"workers": workers, "tokens": sum(best.tokens.values()), "seconds": best.seconds,
                         "tokens_per_s": best.tokens_per_second})
    base = next((r["tokens_per_s"] for r in runs if r["workers"] == 1), None)
    print(f"corpus: {corpus_bytes} bytes, tokenizer: {model.name} (vocab {vocab}), "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, best of {args.repeat}\n")
    print("| measurement | workers | tokens | seconds | tokens/s | vs 1 worker |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| SentencePiece encode, one process (ceiling per core) | - | {tokens} | {seconds:.2f} | {ceiling:,.0f} | - |")
    for r in runs:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| preprocess_data.py | {r['workers']} | {r['tokens']} | {r['seconds']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"ceiling_tokens_per_s": ceiling, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    run_tool(main)
