"""RedPajama-V2's published layout: documents joined with their quality signals and duplicates.

    documents/<snapshot>/<shard>/<lang>_<bucket>.json.gz                one JSON document per line
    quality_signals/<snapshot>/<shard>/<lang>_<bucket>.signals.json.gz  one line per document: {"id",
        "id_int", "metadata", "quality_signals": {name: [[start, end, value], ...]}}
    duplicates/<snapshot>/<shard>/<lang>_<bucket>.duplicates.parquet    column `doc_id`: the documents to drop

A document has no id of its own: its id is `<snapshot>/<shard>/<lang>_<bucket>.json.gz/<row>`
(row = line number from 0), the `id` its signals record carries and the `doc_id` the duplicates
file lists (the first copy of each duplicate cluster is not listed, so dropping every listed
id keeps one copy). Signals are row-aligned with the documents, so the join streams both
files side by side and checks each signals record's id, never holding a file in memory. The
tail partition has neither signals nor duplicates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megazpp.errors import DataError
from megazpp.preprocess.jsonl import SkipReason, strip_jsonl_suffix
from megazpp.preprocess.signal_filter import Signals

DOCUMENTS_DIR, SIGNALS_DIR, DUPLICATES_DIR = "documents", "quality_signals", "duplicates"
SIGNALS_SUFFIX, DUPLICATES_SUFFIX = ".signals.json.gz", ".duplicates.parquet"
PYARROW_HINT = "pip install 'megazpp[redpajama]' (or pip install pyarrow)"


@dataclass(frozen=True)
class V2Files:
    """One documents file's place in the layout and its companion files (None where absent)."""

    base_tag: str  # "<snapshot>/<shard>/<lang>_<bucket>"
    snapshot: str
    signals: Path | None
    duplicates: Path | None

    @property
    def id_prefix(self) -> str:
        """Document ids of this file are this prefix plus the row number."""
        return f"{self.base_tag}.json.gz/"


def v2_files(path: Path) -> V2Files | None:
    """The layout around a documents file, or None if it does not sit under a `documents/` tree."""
    root = next((p for p in path.parents if p.name == DOCUMENTS_DIR), None)
    if root is None:
        return None
    relative = path.relative_to(root)
    base_tag = strip_jsonl_suffix(relative.as_posix())
    signals = root.parent / SIGNALS_DIR / f"{base_tag}{SIGNALS_SUFFIX}"
    duplicates = root.parent / DUPLICATES_DIR / f"{base_tag}{DUPLICATES_SUFFIX}"
    return V2Files(
        base_tag=base_tag,
        snapshot=relative.parts[0] if len(relative.parts) > 1 else base_tag,
        signals=signals if signals.is_file() else None,
        duplicates=duplicates if duplicates.is_file() else None,
    )


def have_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def load_duplicate_rows(path: Path, id_prefix: str) -> np.ndarray:
    """Sorted row numbers of the documents `path` lists as duplicates (ids of other files ignored)."""
    import pyarrow.parquet as pq

    try:
        ids = pq.read_table(path, columns=["doc_id"])["doc_id"].to_pylist()
    except (OSError, KeyError, ValueError) as e:  # pyarrow's errors derive from these
        raise DataError(f"{path}: cannot read the duplicate ids ({type(e).__name__}: {e})") from e
    rows = [
        int(i[len(id_prefix) :])
        for i in ids
        if isinstance(i, str) and i.startswith(id_prefix) and i[len(id_prefix) :].isdigit()
    ]
    return np.unique(np.asarray(rows, dtype=np.int64))


def parse_signals(line: bytes | None, expected_id: str) -> Signals | SkipReason:
    """The `quality_signals` mapping of one signals line, checked to belong to `expected_id`."""
    if line is None:
        return SkipReason.MISSING_SIGNALS
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return SkipReason.MALFORMED_SIGNALS
    signals = record.get("quality_signals") if isinstance(record, dict) else None
    if not isinstance(signals, dict):
        return SkipReason.MALFORMED_SIGNALS
    if record.get("id") != expected_id:
        return SkipReason.SIGNALS_ID_MISMATCH
    return signals
