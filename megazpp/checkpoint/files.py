"""Checkpoint files written atomically and checked against their checksums.

Why a checksum per file: a flipped bit in a tensor's exponent loads without complaint and
turns the loss to 1e34; each rank hashes its file while writing it, `metadata.json` records
the digests, and a file whose bytes differ is refused like any other damaged checkpoint.
A failed write (a full disk) removes what it had written and says why.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from megazpp.checkpoint.format import CHECKSUMS_KEY, METADATA_FILE
from megazpp.errors import CheckpointError
from megazpp.unique_keys import JSONObject


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that hashes what passes through it and remembers the OSError a write met
    (torch.save reports a failed write as a RuntimeError that no longer says why)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.digest.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def _write_failure(path: Path, exc: OSError) -> CheckpointError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left on the device of {path.parent} (writing "
            f"{path.name}; {exc.strerror}): the partial file was removed"
        )
    return CheckpointError(f"cannot write {path} ({exc.strerror or exc}): the partial file was removed")


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> str:
    """`write(file)` into a temporary sibling, flush it to disk, then rename over `path`: a
    reader sees the old file or the whole new one, never a torn write. Returns the written
    bytes' checksum ("sha256:<hex>"). A write that fails for lack of space or another OS
    error removes the temporary file and raises CheckpointError saying why."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer: _HashingWriter | None = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)  # type: ignore[arg-type]  # a write()/flush() file is what savers use
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        cause = writer.error if writer is not None and writer.error is not None else exc
        if isinstance(cause, OSError):
            raise _write_failure(path, cause) from exc
        raise
    return f"sha256:{writer.digest.hexdigest()}"


def verify_checksum(file: Path, metadata: JSONObject) -> None:
    """Refuse `file` when its bytes differ from the checksum `metadata` records for it
    (checkpoints written before checksums were recorded have none: nothing to compare)."""
    checksums = metadata.get(CHECKSUMS_KEY)
    expected = checksums.get(file.name) if isinstance(checksums, dict) else None
    if expected is None:
        return
    actual = file_checksum(file)
    if actual != expected:
        raise CheckpointError(
            f"{file}: checksum mismatch ({actual[:19]}..., {METADATA_FILE} "
            f"records {str(expected)[:19]}...): the file changed after it "
            "was written (disk, copy or memory corruption)"
        )


def file_checksum(path: Path) -> str:
    """ "sha256:<hex>" of a file's bytes, read in blocks (rank files can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"
