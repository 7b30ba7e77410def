"""A chunk of raw JSONL lines -> token arrays, in a preprocessing worker process.

The main process only reads lines (`chunk_reader.py`) and writes tokens (`shard_writer.py`);
workers parse, join RedPajama-V2 signals, filter, extract and tokenize, and send back one flat
token array plus a length array per output. Raw bytes in and NumPy arrays out keep pickling
cheap, so adding workers scales the tokenizer (the real cost) instead of the plumbing.
"""

from __future__ import annotations

import itertools
import signal
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from megazpp.data.tokenizer import Tokenizer
from megazpp.preprocess.jsonl import SkipReason, parse_record, record_set_name, record_text
from megazpp.preprocess.redpajama_v2 import parse_signals
from megazpp.preprocess.shards import safe_name
from megazpp.preprocess.signal_filter import DocumentFilter, FilterSpec


@dataclass
class Chunk:
    """Lines of one shard sent to a worker; the shard's last chunk says so (an empty one for an empty file)."""

    shard: int
    lines: list[bytes]
    source: str
    first_row: int  # row of lines[0] in its file
    id_prefix: str | None  # RedPajama-V2 document id = id_prefix + row
    signals: list[bytes | None] | None  # quality-signal lines in step with `lines`, when rules need them
    duplicates: np.ndarray  # indices into `lines` listed as duplicates
    last: bool = False
    damage: tuple[str, ...] = ()


@dataclass
class ChunkResult:
    """Tokenized documents of one chunk per (key, source): (concatenated tokens, per-document lengths)."""

    shard: int
    last: bool
    damage: tuple[str, ...]
    tokens: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]
    skipped: Counter[str]
    dropped: Counter[str] = field(default_factory=Counter)
    unevaluable: Counter[str] = field(default_factory=Counter)


class ChunkEncoder:
    """Turns a chunk of raw lines into token arrays; one instance lives in each worker."""

    def __init__(
        self,
        tokenizer_model: str,
        json_keys: tuple[str, ...],
        append_eod: bool,
        split_by_source: bool = False,
        filters: FilterSpec = FilterSpec(),
    ):
        self.tokenizer = Tokenizer(tokenizer_model)
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.split_by_source = split_by_source
        self.filter = DocumentFilter(filters) if filters.active else None

    def __call__(self, chunk: Chunk) -> ChunkResult:
        result = ChunkResult(chunk.shard, chunk.last, chunk.damage, {}, Counter())
        texts: dict[tuple[str, str], list[str]] = {}
        duplicates = set(chunk.duplicates.tolist())
        for i, line in enumerate(chunk.lines):
            record = parse_record(line)
            if isinstance(record, SkipReason):
                result.skipped[record.value] += 1
                continue
            if self.filter is not None and not self._keep(chunk, i, i in duplicates, result):
                continue
            source = (safe_name(record_set_name(record) or chunk.source)) if self.split_by_source else ""
            for key in self.json_keys:
                text = record_text(record, key)
                if isinstance(text, SkipReason):
                    result.skipped[self._reason(key, text)] += 1
                else:
                    texts.setdefault((key, source), []).append(text)
        for group, group_texts in texts.items():
            result.tokens[group] = self._encode(group_texts)
        return result

    def _keep(self, chunk: Chunk, i: int, is_duplicate: bool, result: ChunkResult) -> bool:
        if self.filter is None:
            raise RuntimeError("document filtering without a filter")
        signals = None
        if self.filter.spec.needs_signals:
            line = chunk.signals[i] if chunk.signals is not None else None
            parsed = parse_signals(line, f"{chunk.id_prefix}{chunk.first_row + i}")
            if isinstance(parsed, SkipReason):
                result.skipped[parsed.value] += 1
                return False
            signals = parsed
        failure = self.filter.first_failure(signals, is_duplicate)
        if failure is None:
            return True
        rule, unevaluable = failure
        result.dropped[rule] += 1
        result.unevaluable[rule] += unevaluable
        return False

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tokenizer.encode_batch(texts)
        if self.append_eod:
            for doc in ids:
                doc.append(self.tokenizer.eod_id)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return tokens, lengths

    def _reason(self, key: str, reason: SkipReason) -> str:
        return reason.value if len(self.json_keys) == 1 else f"{key}:{reason.value}"


_worker_encoder: ChunkEncoder | None = None


def init_worker(
    tokenizer_model: str, json_keys: tuple[str, ...], append_eod: bool, split_by_source: bool, filters: FilterSpec
) -> None:
    global _worker_encoder
    # Ctrl-C reaches the whole process group: the main process alone handles it (it stops the
    # pool and cleans up), rather than every worker printing its own KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the pool stops its workers with SIGTERM: a Python handler forked from the caller (a program
    # that installed one) would run Python exit code in the worker instead of ending it; in one CI
    # run (the handler a test's in-process tool left behind) a worker so signalled never exited
    # and the pool's join waited forever. The default disposition ends the worker at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = ChunkEncoder(tokenizer_model, json_keys, append_eod, split_by_source, filters)


def encode_in_worker(chunk: Chunk) -> ChunkResult:
    if _worker_encoder is None:
        raise RuntimeError("a preprocessing worker ran before its initializer")
    return _worker_encoder(chunk)
