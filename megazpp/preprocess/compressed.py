"""Opening plain, gzip and zstd files as streams of raw bytes, and spotting a cut-short zstd file.

Corpora like SlimPajama ship as `.jsonl.zst`. Decoding streams (memory does not grow with the
file), but a zstd stream that simply stops mid-frame reads as a clean end of file, so a
download cut short would pass unnoticed. `zstd_damage` walks the frame and block headers (a
seek per 128 KiB block, no decoding) to tell a whole file from a truncated one.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from pathlib import Path
from typing import BinaryIO, cast

import zstandard

# zstd's `--long` mode allows windows up to 2 GiB; the decoder only allocates what a frame asks for.
ZSTD_MAX_WINDOW = 1 << 31
# One zstd block of output per read: a read that fails (a bad block, a frame checksum) loses at
# most this much of what was decoded before the damage.
READ_BUFFER_BYTES = 128 << 10
# What a damaged compressed stream raises, by codec.
READ_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)

_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = range(0x184D2A50, 0x184D2A60)
_DICT_ID_BYTES = (0, 1, 2, 4)
_CONTENT_SIZE_BYTES = (0, 2, 4, 8)  # flag 0 means 1 byte when the frame is a single segment


def open_binary(path: Path) -> BinaryIO:
    """Opens `.gz` and `.zst` transparently; every file is read as raw bytes."""
    if path.name.endswith(".gz"):
        return cast(BinaryIO, gzip.open(path, "rb"))  # a GzipFile reads like any binary file
    if path.name.endswith(".zst"):
        reader = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(
            open(path, "rb"), read_across_frames=True, closefd=True
        )
        return io.BufferedReader(reader, buffer_size=READ_BUFFER_BYTES)
    return open(path, "rb")


def zstd_damage(path: Path) -> str | None:
    """None when every zstd frame of the file is whole; else where the framing breaks."""
    size = os.path.getsize(path)
    pos = 0
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            head = f.read(5)
            if len(head) < 4:
                return f"a frame header at byte {pos} is cut short"
            magic = int.from_bytes(head[:4], "little")
            if magic in _SKIPPABLE_MAGIC:
                f.seek(pos + 4)
                pos += 8 + int.from_bytes(f.read(4), "little")
                continue
            if magic != _ZSTD_MAGIC or len(head) < 5:
                return f"no zstd frame starts at byte {pos}"
            descriptor = head[4]
            single_segment = descriptor >> 5 & 1
            content_size = _CONTENT_SIZE_BYTES[descriptor >> 6] or single_segment
            pos += 5 + (1 - single_segment) + _DICT_ID_BYTES[descriptor & 3] + content_size
            last = False
            while not last:
                f.seek(pos)
                block = f.read(3)
                if len(block) < 3:
                    return f"the frame is cut short at byte {size}"
                header = int.from_bytes(block, "little")
                last, kind, block_size = bool(header & 1), header >> 1 & 3, header >> 3
                pos += 3 + (1 if kind == 1 else block_size)
            pos += 4 * (descriptor >> 2 & 1)  # content checksum
    return f"the last frame is cut short at byte {size}" if pos > size else None
