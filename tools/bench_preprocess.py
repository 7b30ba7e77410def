#!/usr/bin/env python3
"""Benchmarks tools/preprocess_data.py: tokens/s with 1 and 2 (or more) workers on the sample
corpus as .jsonl and as .jsonl.zst, against the single-process SentencePiece encode rate (the
per-core ceiling). Prints a Markdown table for docs/benchmarks.md.

With --memory-bytes N it instead measures resident memory: it writes one .jsonl.zst of N
uncompressed bytes (the sample corpus repeated), runs preprocess_data.py on it in a subprocess
per worker count, and samples the resident set of that process and its workers until it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from megazpp.cli import run_tool
from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.preprocess.jsonl import SkipReason, extract_text, iter_line_chunks, resolve_inputs
from megazpp.preprocess.pipeline import preprocess
from megazpp.preprocess.sample_corpus import DEFAULT_TOTAL_BYTES, build_sample_corpus
from megazpp.preprocess.tokenizer_training import train_tokenizer
from megazpp.unique_keys import JSONObject

TOOLS = Path(__file__).resolve().parent


def encode_ceiling(corpus: str, model: Path) -> tuple[int, float]:
    """(tokens, seconds) of one process encoding every document, with no I/O or JSON in the timing."""
    texts = [
        t
        for path in resolve_inputs(corpus)
        for chunk in iter_line_chunks(path, 1 << 22)
        for t in (extract_text(line, "text") for line in chunk)
        if not isinstance(t, SkipReason)
    ]
    tok = Tokenizer(model)
    start = time.perf_counter()
    ids = tok.encode_batch(texts)
    seconds = time.perf_counter() - start
    return sum(map(len, ids)), seconds


def compress_corpus(corpus: str, out_dir: Path) -> str:
    """The same files as .jsonl.zst (zstd level 3, the zstd tool's default)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in resolve_inputs(corpus):
        (out_dir / f"{path.name}.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(path.read_bytes()))
    return str(out_dir)


def time_runs(args: argparse.Namespace, corpus: str, model: Path, tmp: Path) -> tuple[list[JSONObject], float]:
    tokens, seconds = min((encode_ceiling(corpus, model) for _ in range(args.repeat)), key=lambda r: r[1])
    ceiling = tokens / seconds
    print("| input | workers | tokens | seconds | tokens/s | vs 1 worker | vs encode ceiling |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| SentencePiece encode, one process (ceiling per core) | - | {tokens} | {seconds:.2f} | "
        f"{ceiling:,.0f} | - | 100% |"
    )
    inputs = {"jsonl": corpus} if "jsonl" in args.formats else {}
    if "zst" in args.formats:
        inputs["jsonl.zst"] = compress_corpus(corpus, tmp / "corpus_zst")
    runs = []
    for fmt, path in inputs.items():
        base = None
        for workers in args.workers:
            best = min(
                (
                    preprocess(path, model, tmp / f"out_{fmt}_{workers}", workers=workers, progress=False)
                    for _ in range(args.repeat)
                ),
                key=lambda s: s.seconds,
            )
            rate = best.tokens_per_second
            base = rate if workers == 1 else base
            runs.append(
                {
                    "input": fmt,
                    "workers": workers,
                    "tokens": best.new_tokens,
                    "seconds": best.seconds,
                    "tokens_per_s": rate,
                }
            )
            ratio = f"{rate / base:.2f}x" if base else "-"
            print(
                f"| preprocess_data.py, .{fmt} | {workers} | {best.new_tokens} | {best.seconds:.2f} | {rate:,.0f} | "
                f"{ratio} | {rate / ceiling:.0%} |"
            )
    return runs, ceiling


def write_big_zst(corpus: str, path: Path, total_bytes: int) -> int:
    """One .jsonl.zst of at least `total_bytes` uncompressed: the corpus's lines, repeated."""
    lines = [line for p in resolve_inputs(corpus) for chunk in iter_line_chunks(p, 1 << 22) for line in chunk]
    written = 0
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as out:
        while written < total_bytes:
            for line in lines:
                written += out.write(line)
                if written >= total_bytes:
                    break
    return written


def tree_memory(pid: int) -> tuple[int, int]:
    """(largest resident set of one process, sum of resident sets) over `pid` and its descendants, bytes."""
    pids, rss = [pid], list[int]()
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                rss.extend(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return (max(rss), sum(rss)) if rss else (0, 0)


def measure_memory(args: argparse.Namespace, corpus: str, model: Path, tmp: Path) -> list[JSONObject]:
    big = tmp / "big" / "big.jsonl.zst"
    big.parent.mkdir()
    uncompressed = write_big_zst(corpus, big, args.memory_bytes)
    print(f"input: {big.name}, {uncompressed:,} bytes uncompressed, {big.stat().st_size:,} compressed\n")
    print("| workers | documents | tokens | peak RSS, one process | peak RSS, all processes |")
    print("|---:|---:|---:|---:|---:|")
    results = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOOLS.parent), os.environ.get("PYTHONPATH", "")]))
    for workers in args.workers:
        out = tmp / f"mem{workers}"
        proc = subprocess.Popen(
            [
                sys.executable,
                str(TOOLS / "preprocess_data.py"),
                "--input",
                str(big),
                "--tokenizer-model",
                str(model),
                "--output-prefix",
                str(out),
                "--workers",
                str(workers),
                "--no-progress",
            ],
            stdout=subprocess.DEVNULL,
            env=env,
        )
        peak_one = peak_all = 0
        try:
            while proc.poll() is None:
                one, total = tree_memory(proc.pid)
                peak_one, peak_all = max(peak_one, one), max(peak_all, total)
                time.sleep(0.1)
        finally:
            if proc.poll() is None:  # interrupted: do not leave the run behind
                proc.terminate()
                proc.wait()
        if proc.returncode:
            raise SystemExit(f"preprocess_data.py failed with exit code {proc.returncode}")
        ds = IndexedDataset(f"{out}_text_document")
        documents, tokens = len(ds), int(ds.sequence_lengths.sum(dtype=np.int64))
        del ds
        results.append(
            {
                "workers": workers,
                "documents": documents,
                "tokens": tokens,
                "peak_rss_one": peak_one,
                "peak_rss_all": peak_all,
            }
        )
        print(f"| {workers} | {documents:,} | {tokens:,} | {peak_one / 2**20:,.0f} MiB | {peak_all / 2**20:,.0f} MiB |")
        for suffix in (".bin", ".idx"):
            Path(f"{out}_text_document{suffix}").unlink()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--corpus", help="JSONL file/dir/glob (default: build the sample corpus in a temp dir)")
    parser.add_argument(
        "--total-bytes",
        type=int,
        default=DEFAULT_TOTAL_BYTES,
        help="size of the sample corpus when --corpus is not given",
    )
    parser.add_argument("--tokenizer-model", help="SentencePiece model (default: train one on the corpus)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocab of the trained tokenizer (default 8192)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default 1 2)")
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=["jsonl", "zst"],
        default=["jsonl", "zst"],
        help="inputs to time: the corpus as .jsonl and/or as .jsonl.zst (default both)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per setting; the best is reported (default 3)")
    parser.add_argument(
        "--memory-bytes",
        type=int,
        help="measure resident memory on one .jsonl.zst of this many uncompressed bytes instead",
    )
    parser.add_argument("--tmp-dir", help="where the corpus and outputs go (default: the system temp dir)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_", dir=args.tmp_dir) as tmp_name:
        tmp = Path(tmp_name)
        corpus = args.corpus
        if corpus is None:
            corpus = str(tmp / "corpus")
            build_sample_corpus(corpus, total_bytes=args.total_bytes)
        model = (
            Path(args.tokenizer_model)
            if args.tokenizer_model
            else train_tokenizer(resolve_inputs(corpus), args.vocab_size, tmp / "tok")[0]
        )
        corpus_bytes = sum(p.stat().st_size for p in resolve_inputs(corpus))
        print(
            f"corpus: {corpus_bytes} bytes, tokenizer: {model.name} (vocab {Tokenizer(model).vocab_size}), "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
            + ("" if args.memory_bytes else f", best of {args.repeat}")
            + "\n"
        )
        if args.memory_bytes:
            results: JSONObject = {"memory": measure_memory(args, corpus, model, tmp)}
        else:
            runs, ceiling = time_runs(args, corpus, model, tmp)
            results = {"ceiling_tokens_per_s": ceiling, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    run_tool(main)
