"""JSONL corpus -> Megatron `.bin/.idx`, tokenized in parallel worker processes.

Work unit: a chunk of raw input lines (about `chunk_bytes`). The main process only reads
lines and writes tokens; workers decode, parse, extract and tokenize, and send back one flat
token array plus a length array per chunk. Raw bytes in and NumPy arrays out keep pickling
cheap, and big chunks keep the per-task overhead negligible, so adding workers scales the
tokenizer (the real cost) instead of the plumbing. `Pool.imap` keeps results in input order,
which makes the output independent of the number of workers.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from megazpp.data.indexed_dataset import IndexedDatasetBuilder, token_dtype_for
from megazpp.data.jsonl import SkipReason, extract_text, iter_line_chunks, resolve_inputs
from megazpp.data.tokenizer import Tokenizer

DEFAULT_CHUNK_BYTES = 256 * 1024


@dataclass
class ChunkResult:
    """Tokenized documents of one chunk, per JSON key: (concatenated tokens, per-document lengths)."""

    tokens: dict[str, tuple[np.ndarray, np.ndarray]]
    skipped: Counter


@dataclass
class PreprocessSummary:
    outputs: dict[str, str]
    files: list[Path]
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.tokens.values()) / max(self.seconds, 1e-9)

    def line(self) -> str:
        skipped = ", ".join(f"{r}={n}" for r, n in sorted(self.skipped.items())) or "none"
        return (f"preprocessed {len(self.files)} files: {sum(self.documents.values())} documents, "
                f"{sum(self.tokens.values())} tokens in {self.seconds:.1f} s "
                f"({self.tokens_per_second:,.0f} tokens/s); skipped: {skipped}")


class ChunkEncoder:
    """Turns a chunk of raw lines into token arrays; one instance lives in each worker."""

    def __init__(self, tokenizer_model: str, json_keys: tuple[str, ...], append_eod: bool):
        self.tokenizer = Tokenizer(tokenizer_model)
        self.json_keys = json_keys
        self.append_eod = append_eod

    def __call__(self, lines: list[bytes]) -> ChunkResult:
        skipped: Counter = Counter()
        out = {}
        for key in self.json_keys:
            texts = []
            for line in lines:
                text = extract_text(line, key)
                if isinstance(text, SkipReason):
                    skipped[self._reason(key, text)] += 1
                else:
                    texts.append(text)
            ids = self.tokenizer.encode_batch(texts)
            if self.append_eod:
                for doc in ids:
                    doc.append(self.tokenizer.eod_id)
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
            out[key] = (tokens, lengths)
        return ChunkResult(tokens=out, skipped=skipped)

    def _reason(self, key: str, reason: SkipReason) -> str:
        return reason.value if len(self.json_keys) == 1 else f"{key}:{reason.value}"


_worker_encoder: ChunkEncoder | None = None


def _init_worker(tokenizer_model: str, json_keys: tuple[str, ...], append_eod: bool) -> None:
    global _worker_encoder
    _worker_encoder = ChunkEncoder(tokenizer_model, json_keys, append_eod)


def _encode_in_worker(lines: list[bytes]) -> ChunkResult:
    return _worker_encoder(lines)


def output_prefix_for(output_prefix: str | os.PathLike, key: str) -> str:
    """Megatron's naming: `<prefix>_<key>_document`."""
    return f"{output_prefix}_{key}_document"


def preprocess(input_pattern: str | os.PathLike, tokenizer_model: str | os.PathLike,
               output_prefix: str | os.PathLike, workers: int = 1, json_keys: tuple[str, ...] = ("text",),
               append_eod: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               progress: bool = True) -> PreprocessSummary:
    """Tokenizes every record of the matched files into one indexed dataset per JSON key."""
    files = resolve_inputs(input_pattern)
    tokenizer = Tokenizer(tokenizer_model)  # fail on a bad model before any worker starts
    dtype = token_dtype_for(tokenizer.vocab_size)
    json_keys = tuple(json_keys)
    outputs = {k: output_prefix_for(output_prefix, k) for k in json_keys}
    summary = PreprocessSummary(outputs=outputs, files=files, documents=Counter(), tokens=Counter())
    builders = {k: IndexedDatasetBuilder(p, dtype) for k, p in outputs.items()}
    start = time.perf_counter()
    bar = tqdm(desc="preprocess", unit=" doc", disable=not progress, dynamic_ncols=True)
    try:
        chunks = (c for path in files for c in iter_line_chunks(path, chunk_bytes))
        init_args = (str(tokenizer_model), json_keys, append_eod)
        if workers <= 1:
            encoder = ChunkEncoder(*init_args)
            _write_all(map(encoder, chunks), builders, summary, bar)
        else:
            with Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
                _write_all(pool.imap(_encode_in_worker, chunks), builders, summary, bar)
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


def _write_all(results: Iterator[ChunkResult], builders: dict[str, IndexedDatasetBuilder],
               summary: PreprocessSummary, bar: tqdm) -> None:
    for result in results:
        for key, (tokens, lengths) in result.tokens.items():
            builders[key].add_documents(tokens, lengths)
            summary.documents[key] += len(lengths)
            summary.tokens[key] += len(tokens)
        summary.skipped.update(result.skipped)
        bar.update(sum(len(lengths) for _, lengths in result.tokens.values()))
        bar.set_postfix(tokens=sum(summary.tokens.values()), refresh=False)
