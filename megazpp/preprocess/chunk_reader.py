"""The input shards' lines cut into chunks for the workers, with what RedPajama-V2 adds.

Work unit: a chunk of raw input lines (about `chunk_bytes`) of one file, with the matching
quality-signal lines (when filter rules need them) and the rows listed as duplicates. Big chunks
keep the per-task overhead negligible. Each shard's last chunk says so and carries what was
damaged: a damaged file keeps the lines read before the damage and loses the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megazpp.errors import DataError
from megazpp.preprocess.chunk_encoder import Chunk
from megazpp.preprocess.jsonl import iter_line_chunks
from megazpp.preprocess.redpajama_v2 import load_duplicate_rows
from megazpp.preprocess.shards import Shard
from megazpp.preprocess.signal_filter import FilterSpec

DEFAULT_CHUNK_BYTES = 256 * 1024
_NO_ROWS = np.empty(0, dtype=np.int64)


class SignalLines:
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


def read_chunks(shards: list[Shard], indices: list[int], chunk_bytes: int, filters: FilterSpec) -> Iterator[Chunk]:
    """Every chunk of the given shards in order, each shard closed by an end marker carrying what
    was damaged. A damaged file keeps the lines read before the damage and loses the rest."""
    for index in indices:
        shard, damage = shards[index], list[str]()
        v2 = shard.v2
        signals = SignalLines(v2.signals, damage) if filters.needs_signals and v2 and v2.signals else None
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
