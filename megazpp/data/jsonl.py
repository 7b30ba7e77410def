"""Reading RedPajama-style JSONL (plain or gzip) and pulling one text field out of each record.

A web-scale corpus always holds some broken lines. They must never stop a multi-hour
preprocessing run, yet silently dropping them hides real problems, so every rejected record
is classified by a `SkipReason` that the tools count and print.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from enum import Enum
from pathlib import Path
from typing import Iterator

from megazpp.errors import DataError

# RedPajama v2 stores the document under `raw_content`; v1 (and Megatron) under `text`.
KEY_ALIASES = {"text": ("text", "raw_content")}

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


class SkipReason(str, Enum):
    """Why a line did not become a document."""

    BLANK_LINE = "blank_line"
    NON_UTF8 = "non_utf8"
    MALFORMED_JSON = "malformed_json"
    NOT_AN_OBJECT = "not_an_object"
    MISSING_KEY = "missing_key"
    NOT_A_STRING = "not_a_string"
    EMPTY_DOCUMENT = "empty_document"


def resolve_inputs(pattern: str | os.PathLike) -> list[Path]:
    """A file, a directory (its JSONL files) or a glob, as a sorted list of existing files."""
    pattern = str(pattern)
    if os.path.isdir(pattern):
        paths = [p for p in Path(pattern).iterdir() if p.name.endswith(JSONL_SUFFIXES)]
    else:
        paths = [Path(p) for p in glob.glob(pattern)]
    files = sorted(p for p in paths if p.is_file())
    if not files:
        raise DataError(f"input {pattern!r} matches no JSONL file (expected a .jsonl/.jsonl.gz file, "
                        f"a directory holding them, or a glob)")
    return files


def open_binary(path: Path):
    """Opens `.gz` transparently; lines stay raw bytes so decoding errors can be counted."""
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def iter_line_chunks(path: Path, chunk_bytes: int) -> Iterator[list[bytes]]:
    """Raw lines of one file grouped into chunks of about `chunk_bytes` (the unit of work sent to
    a worker: big enough that inter-process overhead is negligible)."""
    chunk: list[bytes] = []
    size = 0
    try:
        with open_binary(path) as f:
            for line in f:
                chunk.append(line)
                size += len(line)
                if size >= chunk_bytes:
                    yield chunk
                    chunk, size = [], 0
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e}); a truncated or corrupt file?") from e
    if chunk:
        yield chunk


def extract_text(line: bytes, key: str) -> str | SkipReason:
    """The document under `key` (or its RedPajama alias), or the reason the line is unusable."""
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
