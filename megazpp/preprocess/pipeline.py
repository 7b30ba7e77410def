"""JSONL corpus (one file or thousands) -> Megatron `.bin/.idx`, tokenized in parallel worker processes.

The pipeline, one module a stage: the main process reads each input file's lines in chunks
(`chunk_reader.py`), workers turn chunks into token arrays (`chunk_encoder.py`), and the main
process writes them into each file's shard (`shard_writer.py`). `Pool.imap` keeps results in
input order, which makes the output independent of the number of workers, and its pipe bounds
the chunks in flight, so memory does not grow with the input.

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
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

from megazpp.data.indexed_dataset import merge_indexed_datasets, token_dtype_for
from megazpp.data.tokenizer import Tokenizer
from megazpp.data.tokenizer_record import TokenizerRecord, write_record
from megazpp.errors import DataError, refuse_existing
from megazpp.preprocess.chunk_encoder import ChunkEncoder, ChunkResult, encode_in_worker, init_worker
from megazpp.preprocess.chunk_reader import DEFAULT_CHUNK_BYTES, read_chunks
from megazpp.preprocess.jsonl import KEY_ALIASES, input_root, record_keys, resolve_inputs
from megazpp.preprocess.progress import Progress
from megazpp.preprocess.redpajama_v2 import PYARROW_HINT, have_pyarrow
from megazpp.preprocess.shard_writer import ShardWriter, output_prefix_for, remove_shards
from megazpp.preprocess.shards import (
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
from megazpp.preprocess.signal_filter import FilterSpec


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
    input_pattern: str | os.PathLike[str],
    tokenizer_model: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
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
    writer = ShardWriter(shards, shard_dir, json_keys, split_by_source, token_dtype_for(tokenizer.vocab_size), record)
    try:
        chunks = read_chunks(shards, pending, chunk_bytes, filters)
        init_args = (str(tokenizer_model), json_keys, append_eod, split_by_source, filters)
        if workers <= 1 or not pending:
            _consume(map(ChunkEncoder(*init_args), chunks), writer, results, identities, fingerprint, summary, bar)
        else:
            with Pool(workers, initializer=init_worker, initargs=init_args) as pool:
                _consume(pool.imap(encode_in_worker, chunks), writer, results, identities, fingerprint, summary, bar)
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
                remove_shards(shard_dir, shards, finished)
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
    output_prefix: str | os.PathLike[str], json_keys: tuple[str, ...], split_by_source: bool, shard_dir: Path
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
        remove_shards(shard_dir, shards, results)
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


def _consume(
    results: Iterable[ChunkResult],
    writer: ShardWriter,
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
