"""Writing the tokenized chunks into each input file's shard, in input order, and removing shards.

Each input file is a shard (`shards.py`): written to its own `.bin/.idx` under
`<output-prefix>_shards/` (with its tokenizer record), finished with a marker that a rerun
skips it by; `remove_shards` deletes exactly what the shards wrote once they are merged (or a
run is refused). Output names follow Megatron's `<prefix>_<key>_document`.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from megazpp.data.indexed_dataset import IndexedDatasetBuilder, data_file, index_file
from megazpp.data.tokenizer_record import TokenizerRecord, record_file, write_record
from megazpp.preprocess.chunk_encoder import ChunkResult
from megazpp.preprocess.shards import Shard, ShardResult, marker_path


def output_prefix_for(output_prefix: str | os.PathLike[str], key: str, source: str = "") -> str:
    """Megatron's naming, `<prefix>_<key>_document`; split by source, `<prefix>_<source>_<key>_document`."""
    return f"{output_prefix}_{source}_{key}_document" if source else f"{output_prefix}_{key}_document"


def output_label(key: str, source: str) -> str:
    """How the summary names an output: the key, or `<source>:<key>` when split by source."""
    return f"{source}:{key}" if source else key


class ShardWriter:
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


def remove_shards(shard_dir: Path, shards: list[Shard], results: list[ShardResult]) -> None:
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
