"""JSONL corpus (one file or thousands) -> Megatron `.bin/.idx`, tokenized in parallel worker processes.

Work unit: a chunk of raw input lines (about `chunk_bytes`) of one file. The main process only
reads lines (and, for RedPajama-V2, the matching quality-signal lines and duplicate rows) and
writes tokens; workers parse, join, filter, extract and tokenize, and send back one flat token
array plus a length array per output. Raw bytes in and NumPy arrays out keep pickling cheap,
and big chunks keep the per-task overhead negligible, so adding workers scales the tokenizer
(the real cost) instead of the plumbing. `Pool.imap` keeps results in input order, which makes
the output independent of the number of workers, and its pipe bounds the chunks in flight, so
memory does not grow with the input.

Each input file is a shard (`shards.py`): written to its own `.bin/.idx` under
`<output-prefix>_shards/`, finished with a marker, skipped by a rerun; at the end the shards are
merged in file order into `<output-prefix>_<key>_document` (unless kept per shard). Every
dataset written gets its tokenizer record beside it (`tokenizer_record.py`).

What is refused, before anything is written: an output prefix whose dataset exists (outputs
are never overwritten; the exception is a prefix whose `<output-prefix>_shards/` is there, the
interrupted or `--keep-shards` run that the same command resumes or updates). After the files
are read: a key under which no record held a document (an empty input, or the wrong key), named
with the keys the records do have, instead of a 0-document dataset.
"""

from __future__ import annotations

import glob
import itertools
import os
import signal
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from megazpp.data.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file,
    index_file,
    merge_indexed_datasets,
    token_dtype_for,
)
from megazpp.data.jsonl import (
    KEY_ALIASES,
    SkipReason,
    input_root,
    iter_line_chunks,
    parse_record,
    record_keys,
    record_set_name,
    record_text,
    resolve_inputs,
)
from megazpp.data.progress import Progress
from megazpp.data.redpajama_v2 import PYARROW_HINT, have_pyarrow, load_duplicate_rows, parse_signals
from megazpp.data.shards import (
    DocumentCounts,
    Shard,
    ShardResult,
    file_identity,
    marker_path,
    options_fingerprint,
    plan_shards,
    read_marker,
    safe_name,
    write_marker,
)
from megazpp.data.signal_filter import DocumentFilter, FilterSpec
from megazpp.data.tokenizer import Tokenizer
from megazpp.data.tokenizer_record import TokenizerRecord, record_file, write_record
from megazpp.errors import DataError, refuse_existing

DEFAULT_CHUNK_BYTES = 256 * 1024
_NO_ROWS = np.empty(0, dtype=np.int64)


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
    skipped: Counter
    dropped: Counter = field(default_factory=Counter)
    unevaluable: Counter = field(default_factory=Counter)


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


def _init_worker(
    tokenizer_model: str, json_keys: tuple[str, ...], append_eod: bool, split_by_source: bool, filters: FilterSpec
) -> None:
    global _worker_encoder
    # Ctrl-C reaches the whole process group: the main process alone handles it (it stops the
    # pool and cleans up), rather than every worker printing its own KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_encoder = ChunkEncoder(tokenizer_model, json_keys, append_eod, split_by_source, filters)


def _encode_in_worker(chunk: Chunk) -> ChunkResult:
    if _worker_encoder is None:
        raise RuntimeError("a preprocessing worker ran before its initializer")
    return _worker_encoder(chunk)


def output_prefix_for(output_prefix: str | os.PathLike, key: str, source: str = "") -> str:
    """Megatron's naming, `<prefix>_<key>_document`; split by source, `<prefix>_<source>_<key>_document`."""
    return f"{output_prefix}_{source}_{key}_document" if source else f"{output_prefix}_{key}_document"


def output_label(key: str, source: str) -> str:
    """How the summary names an output: the key, or `<source>:<key>` when split by source."""
    return f"{source}:{key}" if source else key


@dataclass(kw_only=True)
class PreprocessSummary(DocumentCounts):
    outputs: dict[str, str]  # label -> merged prefix (empty when kept per shard)
    files: list[Path]
    shard_outputs: dict[str, list[str]] = field(default_factory=dict)  # label -> shard prefixes, in file order
    resumed: int = 0  # shards finished by an earlier run and not redone
    new_tokens: int = 0  # tokenized by this run (the rate's numerator)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    def add(self, result: ShardResult) -> None:
        for label, prefix in result.outputs.items():
            self.shard_outputs.setdefault(label, []).append(prefix)
        self.add_counts(result)

    def line(self) -> str:
        skipped = ", ".join(f"{r}={n}" for r, n in sorted(self.skipped.items())) or "none"
        text = (
            f"preprocessed {len(self.files)} files: {sum(self.documents.values())} documents, "
            f"{sum(self.tokens.values())} tokens in {self.seconds:.1f} s "
            f"({self.tokens_per_second:,.0f} tokens/s); skipped: {skipped}"
        )
        if self.resumed:
            text += f"; {self.resumed} files were done by an earlier run (the rate counts this run's tokens)"
        if self.dropped:
            rules = ", ".join(
                f"[{rule}]={n}" + (f" ({self.unevaluable[rule]} unevaluable)" if self.unevaluable[rule] else "")
                for rule, n in self.dropped.items()
            )
            text += f"; dropped by rule: {rules}"
        if self.damage:
            text += f"; damaged input files: {len(self.damage)} (warnings above)"
        return text


def preprocess(
    input_pattern: str | os.PathLike,
    tokenizer_model: str | os.PathLike,
    output_prefix: str | os.PathLike,
    workers: int = 1,
    json_keys: tuple[str, ...] = ("text",),
    append_eod: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = True,
    filters: FilterSpec = FilterSpec(),
    split_by_source: bool = False,
    per_shard: bool = False,
    keep_shards: bool = False,
) -> PreprocessSummary:
    """Tokenizes every record of the matched files into one indexed dataset per JSON key (and
    source, with `split_by_source`): merged, or one per input file with `per_shard`."""
    start = time.perf_counter()
    shards = plan_shards(resolve_inputs(input_pattern), input_root(input_pattern))
    tokenizer = Tokenizer(tokenizer_model)  # fail on a bad model before any worker starts
    _check_filters(shards, filters)
    json_keys = tuple(json_keys)
    for key in json_keys:
        if safe_name(key) != key:
            raise DataError(f"JSON key {key!r} cannot name an output file: use letters, digits, '.', '_' or '-'")
    shard_dir = Path(f"{output_prefix}_shards")
    if not per_shard:
        _refuse_existing_outputs(output_prefix, json_keys, split_by_source, shard_dir)
    record = TokenizerRecord.of(tokenizer_model, tokenizer.vocab_size)
    fingerprint = options_fingerprint(
        Path(tokenizer_model),
        {
            "json_keys": json_keys,
            "append_eod": append_eod,
            "split_by_source": split_by_source,
            "filters": filters.describe(),
        },
    )
    identities = [file_identity(_inputs_of(shard, filters)) for shard in shards]
    results = [read_marker(marker_path(shard_dir, s), ident, fingerprint) for s, ident in zip(shards, identities)]
    pending = [i for i, r in enumerate(results) if r is None]
    summary = PreprocessSummary(outputs={}, files=[s.path for s in shards], resumed=len(shards) - len(pending))
    bar = Progress(len(shards), summary.resumed, bars=progress)
    writer = _ShardWriter(shards, shard_dir, json_keys, split_by_source, token_dtype_for(tokenizer.vocab_size), record)
    try:
        chunks = _chunks(shards, pending, chunk_bytes, filters)
        init_args = (str(tokenizer_model), json_keys, append_eod, split_by_source, filters)
        if workers <= 1 or not pending:
            _consume(map(ChunkEncoder(*init_args), chunks), writer, results, identities, fingerprint, summary, bar)
        else:
            with Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
                _consume(pool.imap(_encode_in_worker, chunks), writer, results, identities, fingerprint, summary, bar)
        finished = [r for r in results if r is not None]
        if len(finished) != len(results):
            raise RuntimeError(f"{len(results) - len(finished)} input file(s) ended without a result")
        for result in finished:
            summary.add(result)
        _refuse_empty_keys(json_keys, summary, shards, shard_dir, finished)
        summary.dropped = Counter(
            {rule: summary.dropped[rule] for rule in filters.rule_order() if rule in summary.dropped}
        )
        if not per_shard:
            for label, prefixes in summary.shard_outputs.items():
                source, _, key = label.rpartition(":")
                summary.outputs[label] = output_prefix_for(output_prefix, key, source)
                merge_indexed_datasets(prefixes, summary.outputs[label])
                write_record(summary.outputs[label], record)
            if not keep_shards:
                _remove_shards(shard_dir, shards, finished)
    except KeyboardInterrupt:
        writer.abort()
        raise KeyboardInterrupt(_interrupted(results, shard_dir)) from None
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    summary.seconds = time.perf_counter() - start
    return summary


def _interrupted(results: list[ShardResult | None], shard_dir: Path) -> str:
    """What a Ctrl-C left: finished shards stay for the same command to resume from."""
    done = sum(r is not None for r in results)
    text = (
        f"{done} of {len(results)} input files were finished and are kept under {shard_dir}/ (the same "
        "command resumes from them)"
    )
    return text + ("; the file in flight was removed" if done < len(results) else "")


def _refuse_existing_outputs(
    output_prefix: str | os.PathLike, json_keys: tuple[str, ...], split_by_source: bool, shard_dir: Path
) -> None:
    """A dataset already at the output prefix is refused (outputs are never overwritten), unless
    the prefix's shard directory is there: then this run resumes an interrupted one, or updates
    a `--keep-shards` one, from those shards."""
    if shard_dir.is_dir():
        return
    for key in json_keys:
        pattern = output_prefix_for(glob.escape(str(output_prefix)), key, "*" if split_by_source else "")
        for existing in sorted(glob.glob(f"{pattern}.idx") + glob.glob(f"{pattern}.bin"))[:1]:
            refuse_existing(
                existing,
                DataError,
                found="already exists (a preprocessed dataset)",
                instead="choose another --output-prefix, or remove that dataset first",
            )


def _refuse_empty_keys(
    json_keys: tuple[str, ...],
    summary: PreprocessSummary,
    shards: list[Shard],
    shard_dir: Path,
    results: list[ShardResult],
) -> None:
    """A key under which no record held a document would make a 0-document dataset: refused,
    naming the key and the keys the records do have (the shards this run wrote are removed:
    they hold nothing under that key)."""
    for key in json_keys:
        if any(n for label, n in summary.documents.items() if label.rpartition(":")[2] == key):
            continue
        _remove_shards(shard_dir, shards, results)
        names = " or ".join(repr(k) for k in KEY_ALIASES.get(key, (key,)))
        where = f"{len(shards)} input files" if len(shards) > 1 else str(shards[0].path)
        skipped = ", ".join(f"{r}={n}" for r, n in sorted(summary.skipped.items()))
        seen = record_keys([s.path for s in shards])
        if not skipped:
            raise DataError(
                f"no document under key {names} in {where}: "
                f"{'they hold' if len(shards) > 1 else 'it holds'} no records; nothing to write"
            )
        raise DataError(
            f"no document under key {names} in {where} (skipped: {skipped}; keys seen in the records: "
            f"{', '.join(map(repr, seen)) or 'none'}): nothing to write; give --json-keys the key "
            "that holds the text"
        )


def _inputs_of(shard: Shard, filters: FilterSpec) -> list[Path]:
    companions = []
    if shard.v2 is not None:
        if filters.needs_signals and shard.v2.signals is not None:
            companions.append(shard.v2.signals)
        if filters.drop_duplicates and shard.v2.duplicates is not None:
            companions.append(shard.v2.duplicates)
    return [shard.path, *companions]


def _check_filters(shards: list[Shard], filters: FilterSpec) -> None:
    """Filters that cannot act on these inputs are refused before any work."""
    if filters.needs_signals and not any(s.v2 is not None and s.v2.signals is not None for s in shards):
        raise DataError(
            f"filter rules need RedPajama-V2 quality signals, but none of the {len(shards)} input "
            f"files has quality_signals/<name>.signals.json.gz beside its documents/ directory"
        )
    if filters.drop_duplicates:
        if not any(s.v2 is not None for s in shards):
            raise DataError(
                "--drop-duplicates needs RedPajama-V2's layout (documents/ beside duplicates/), "
                "but no input file sits under a documents/ directory"
            )
        parquet = next((s.v2.duplicates for s in shards if s.v2 is not None and s.v2.duplicates is not None), None)
        if parquet is not None and not have_pyarrow():
            raise DataError(f"--drop-duplicates reads {parquet}, a parquet file, which needs pyarrow: {PYARROW_HINT}")


class _SignalLines:
    """The quality-signal lines of one file handed out in step with its documents; once the file
    ends or breaks, None (those documents have no signals)."""

    def __init__(self, path: Path, damage: list[str]):
        self._lines = self._read(path, damage)

    @staticmethod
    def _read(path: Path, damage: list[str]) -> Iterator[bytes]:
        try:
            for chunk in iter_line_chunks(path, DEFAULT_CHUNK_BYTES):
                yield from chunk
        except DataError as e:
            damage.append(f"{e}; the documents after that line have no signals (skipped as missing_signals)")

    def take(self, n: int) -> list[bytes | None]:
        return [next(self._lines, None) for _ in range(n)]


def _chunks(shards: list[Shard], indices: list[int], chunk_bytes: int, filters: FilterSpec) -> Iterator[Chunk]:
    """Every chunk of the given shards in order, each shard closed by an end marker carrying what
    was damaged. A damaged file keeps the lines read before the damage and loses the rest."""
    for index in indices:
        shard, damage = shards[index], list[str]()
        v2 = shard.v2
        signals = _SignalLines(v2.signals, damage) if filters.needs_signals and v2 and v2.signals else None
        duplicate_rows = _NO_ROWS
        if filters.drop_duplicates and v2 is not None and v2.duplicates is not None:
            try:
                duplicate_rows = load_duplicate_rows(v2.duplicates, v2.id_prefix)
            except DataError as e:
                damage.append(f"{e}; no document of {shard.path} is dropped as a duplicate")
        row, held = 0, None  # each chunk is held back one step, so the last one can carry the end marker
        try:
            for lines in iter_line_chunks(shard.path, chunk_bytes):
                if held is not None:
                    yield held
                n = len(lines)
                lo, hi = np.searchsorted(duplicate_rows, [row, row + n])
                held = Chunk(
                    index,
                    lines,
                    shard.source,
                    row,
                    v2.id_prefix if v2 else None,
                    signals.take(n) if signals else None,
                    duplicate_rows[lo:hi] - row,
                )
                row += n
        except DataError as e:
            damage.append(f"{e}; kept the lines before it, skipped the rest of the file")
        last = held or Chunk(index, [], shard.source, row, None, None, _NO_ROWS)
        last.last, last.damage = True, tuple(damage)
        yield last


class _ShardWriter:
    """Writes the open shard's outputs; `finish` completes them and returns the shard's result."""

    def __init__(
        self,
        shards: list[Shard],
        shard_dir: Path,
        json_keys: tuple[str, ...],
        split_by_source: bool,
        dtype: np.dtype,
        record: TokenizerRecord,
    ):
        self.shards, self.shard_dir, self.json_keys = shards, shard_dir, json_keys
        self.split_by_source, self.dtype, self.record = split_by_source, dtype, record
        self.index: int | None = None
        self.builders: dict[tuple[str, str], IndexedDatasetBuilder] = {}
        self.result = ShardResult()

    def _base(self) -> Path:
        if self.index is None:
            raise RuntimeError("no shard is being written")
        return self.shard_dir / self.shards[self.index].name

    def start(self, index: int) -> None:
        self.index, self.builders, self.result = index, {}, ShardResult()
        base = self._base()
        marker_path(self.shard_dir, self.shards[index]).unlink(missing_ok=True)
        for stale in glob.glob(f"{glob.escape(str(base))}_*_document.*.tmp*"):  # from a killed run
            os.unlink(stale)
        if not self.split_by_source:
            for key in self.json_keys:
                self._builder(key, "")

    def _builder(self, key: str, source: str) -> IndexedDatasetBuilder:
        builder = self.builders.get((key, source))
        if builder is None:
            prefix = output_prefix_for(self._base(), key, source)
            builder = self.builders[(key, source)] = IndexedDatasetBuilder(prefix, self.dtype)
            self.result.outputs[output_label(key, source)] = prefix
        return builder

    def add(self, result: ChunkResult) -> int:
        if result.shard != self.index:
            self.start(result.shard)
        tokens = 0
        for (key, source), (ids, lengths) in result.tokens.items():
            self._builder(key, source).add_documents(ids, lengths)
            label = output_label(key, source)
            self.result.documents[label] += len(lengths)
            self.result.tokens[label] += len(ids)
            tokens += len(ids)
        self.result.skipped.update(result.skipped)
        self.result.dropped.update(result.dropped)
        self.result.unevaluable.update(result.unevaluable)
        self.result.damage.extend(result.damage)
        return tokens

    def finish(self) -> ShardResult:
        for builder in self.builders.values():
            builder.finalize()
            write_record(builder.prefix, self.record)
        self.builders = {}
        return self.result

    def abort(self) -> None:
        for builder in self.builders.values():
            builder.abort()
        self.builders = {}


def _consume(
    results: Iterable[ChunkResult],
    writer: _ShardWriter,
    shard_results: list[ShardResult | None],
    identities: list[list[list[object]]],
    fingerprint: str,
    summary: PreprocessSummary,
    bar: Progress,
) -> None:
    for result in results:
        tokens = writer.add(result)
        summary.new_tokens += tokens
        for message in result.damage:
            bar.write(f"warning: {message}")
        if result.last:
            done = writer.finish()
            write_marker(
                marker_path(writer.shard_dir, writer.shards[result.shard]), identities[result.shard], fingerprint, done
            )
            shard_results[result.shard] = done
        bar.update(files=int(result.last), tokens=tokens)


def _remove_shards(shard_dir: Path, shards: list[Shard], results: list[ShardResult]) -> None:
    """Deletes exactly what the shards wrote (outputs, markers), then the directories left empty."""
    for shard, result in zip(shards, results):
        for prefix in result.outputs.values():
            for path in (data_file(prefix), index_file(prefix), record_file(prefix)):
                path.unlink(missing_ok=True)
        marker_path(shard_dir, shard).unlink(missing_ok=True)
    for directory in sorted(
        {p for s in shards for p in (shard_dir / s.name).parents if p == shard_dir or shard_dir in p.parents},
        key=lambda p: -len(p.parts),
    ):
        try:
            directory.rmdir()
        except OSError:
            pass  # not empty: something of the user's is in it
