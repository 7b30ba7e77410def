"""Reading RedPajama-style JSONL (plain, gzip or zstd) and pulling one text field out of each record.

A web-scale corpus always holds some broken lines. They must never stop a multi-hour
preprocessing run, yet silently dropping them hides real problems, so every rejected record
is classified by a `SkipReason` that the tools count and print.
"""

from __future__ import annotations

import codecs
import glob
import itertools
import json
import os
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

from megazpp.errors import DataError
from megazpp.preprocess.compressed import READ_ERRORS, open_binary, zstd_damage

# RedPajama v2 stores the document under `raw_content`; v1 (and Megatron) under `text`.
KEY_ALIASES = {"text": ("text", "raw_content")}

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst")
# RedPajama-V2 keeps its quality signals beside the documents with a JSON suffix of their own;
# a directory walk must not take them for documents.
COMPANION_SUFFIXES = (".signals.json.gz",)


class SkipReason(str, Enum):
    """Why a line did not become a document."""

    BLANK_LINE = "blank_line"
    NON_UTF8 = "non_utf8"
    MALFORMED_JSON = "malformed_json"
    NOT_AN_OBJECT = "not_an_object"
    MISSING_KEY = "missing_key"
    NOT_A_STRING = "not_a_string"
    EMPTY_DOCUMENT = "empty_document"
    # RedPajama-V2 joins (only when filters need the quality signals)
    MISSING_SIGNALS = "missing_signals"
    MALFORMED_SIGNALS = "malformed_signals"
    SIGNALS_ID_MISMATCH = "signals_id_mismatch"


def is_document_file(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES) and not path.name.endswith(COMPANION_SUFFIXES)


def strip_jsonl_suffix(name: str) -> str:
    for suffix in sorted(JSONL_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def resolve_inputs(pattern: str | os.PathLike[str]) -> list[Path]:
    """A file, a directory (its JSONL files, recursively; for a RedPajama-V2 download, those
    under its `documents/`) or a glob, as a sorted list of existing files."""
    pattern = str(pattern)
    if os.path.isdir(pattern):
        root = Path(pattern)
        if (root / "documents").is_dir():
            root = root / "documents"
        paths = [p for p in root.rglob("*") if is_document_file(p)]
    else:
        paths = [Path(p) for p in glob.glob(pattern, recursive=True)]
    files = sorted(p for p in paths if p.is_file())
    if not files:
        raise DataError(
            f"input {pattern!r} matches no JSONL file (expected a .jsonl/.jsonl.gz/.jsonl.zst "
            f"file, a directory holding them, or a glob)"
        )
    return files


def input_root(pattern: str | os.PathLike[str]) -> Path:
    """The directory the input's files are named relative to: a directory input itself, a glob's
    fixed leading directories, or a single file's parent."""
    pattern = str(pattern)
    if os.path.isdir(pattern):
        return Path(pattern)
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
    if len(fixed) == len(parts):  # a plain file name
        return Path(pattern).parent
    return Path(*fixed) if fixed else Path(".")


def iter_line_chunks(path: Path, chunk_bytes: int) -> Iterator[list[bytes]]:
    """Raw lines of one file grouped into chunks of about `chunk_bytes` (the unit of work sent to
    a worker: big enough that inter-process overhead is negligible).

    A damaged file first yields every whole line read before the damage, then raises a
    `DataError` naming the file and the last good line, so a caller can keep what was read."""
    chunk: list[bytes] = []
    size = lines = 0
    damage = None
    try:
        damage = zstd_damage(path) if path.name.endswith(".zst") else None
        with open_binary(path) as f:
            for line in f:
                chunk.append(line)
                size += len(line)
                lines += 1
                if size >= chunk_bytes:
                    yield chunk
                    chunk, size = [], 0
    except READ_ERRORS as e:
        damage = f"{type(e).__name__}: {e}"
    if damage and chunk and not chunk[-1].endswith(b"\n"):  # the cut-off start of a line
        chunk.pop()
        lines -= 1
    if chunk:
        yield chunk
    if damage:
        raise DataError(f"{path}: cannot read past line {lines}, truncated or corrupt ({damage})")


JsonRecord = dict[str, object]


def parse_record(line: bytes) -> JsonRecord | SkipReason:
    """One JSONL line as a JSON object, or the reason it is unusable. A UTF-8 byte-order mark
    (which editors on Windows put at the start of a file) is not part of the record: it is
    dropped, as Python's `utf-8-sig` codec does, instead of losing the file's first document."""
    if line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8) :]
    if not line.strip():
        return SkipReason.BLANK_LINE
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError:
        return SkipReason.NON_UTF8
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError:
        return SkipReason.MALFORMED_JSON
    if not isinstance(record, dict):
        return SkipReason.NOT_AN_OBJECT
    return record


def record_text(record: JsonRecord, key: str) -> str | SkipReason:
    """The document under `key` (or its RedPajama alias), or the reason there is none."""
    for name in KEY_ALIASES.get(key, (key,)):
        if name in record:
            text = record[name]
            break
    else:
        return SkipReason.MISSING_KEY
    if not isinstance(text, str):
        return SkipReason.NOT_A_STRING
    if not text.strip():
        return SkipReason.EMPTY_DOCUMENT
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a JSON "\ud800" escape: a lone surrogate is not valid text
        return SkipReason.NON_UTF8
    return text


def extract_text(line: bytes, key: str) -> str | SkipReason:
    """The document under `key` in one raw line, or the reason the line is unusable."""
    record = parse_record(line)
    return record if isinstance(record, SkipReason) else record_text(record, key)


def record_keys(files: list[Path], max_lines: int = 1000) -> list[str]:
    """The top-level keys of the records in the first `max_lines` lines of each file (sorted), to
    name in an error when the asked-for key holds nothing."""
    keys: set[str] = set()
    for path in files:
        try:
            with open_binary(path) as f:
                for line in itertools.islice(f, max_lines):
                    record = parse_record(line)
                    if isinstance(record, dict):
                        keys.update(record)
        except READ_ERRORS:
            continue  # a damaged file was reported by the run itself
    return sorted(keys)


def record_set_name(record: JsonRecord) -> str | None:
    """RedPajama v1's source name (`meta.redpajama_set_name`, as SlimPajama ships it), if any."""
    meta = record.get("meta")
    name = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None
