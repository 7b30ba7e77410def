"""Megatron's memory-mapped indexed dataset (`.bin` tokens + `.idx` index), read and written.

The layout is Megatron-LM's, byte for byte, so datasets made by either project load in the
other. `.idx`, all little-endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the tokens in .bin (see DTYPE_CODES)
    uint64    S, number of sequences
    uint64    D, number of entries in the document index (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence byte offsets into .bin
    int64[D]  document index: document d is sequences [doc[d], doc[d+1])

`.bin` is the token arrays of all sequences back to back. With GPT preprocessing every
document is one sequence. The reader checks every count and offset against the file sizes
up front, because a truncated file otherwise shows up hours later as garbage tokens or a
segfault in a data-loader worker.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from megazpp.data.index_cache import cache_key, load_or_build
from megazpp.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")
_COPY_BLOCK = 16 << 20


def data_file(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{prefix}.bin")


def index_file(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{prefix}.idx")


def token_dtype_for(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (half the disk and page cache), else int32 (Megatron's rule)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDataset:
    """Read-only view of a `.bin/.idx` pair; `ds[i]` is sequence i as a NumPy array (no copy)."""

    def __init__(self, prefix: str | os.PathLike[str]):
        self.prefix = str(prefix)
        self.idx_path, self.bin_path = index_file(prefix), data_file(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise DataError(f"indexed dataset file {p} does not exist (prefix {self.prefix!r})")
        self._index = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if self.idx_path.stat().st_size else None
        self._parse_index()
        bin_size = self.bin_path.stat().st_size
        expected = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if bin_size != expected:
            raise DataError(
                f"{self.bin_path}: {bin_size} bytes, but {self.idx_path} describes "
                f"{expected} bytes of {self.dtype.name} tokens (truncated or mismatched pair)"
            )
        self._data = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if bin_size else np.empty(0, self.dtype)

    def _parse_index(self) -> None:
        idx, name = self._index, self.idx_path
        size = 0 if idx is None else len(idx)
        if idx is None or size < _HEADER.size:
            raise DataError(f"{name}: {size} bytes is shorter than the {_HEADER.size}-byte index header (truncated)")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(idx[: _HEADER.size]))
        if magic != MAGIC:
            raise DataError(f"{name}: not a Megatron indexed-dataset index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise DataError(f"{name}: index version {version}, only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise DataError(f"{name}: unknown token dtype code {code} (expected one of {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size < expected:
            raise DataError(
                f"{name}: {size} bytes, but its header announces {n_seq} sequences and {n_doc} "
                f"document-index entries needing {expected} bytes (truncated)"
            )
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=offset)
        self._check_consistency()

    def _check_consistency(self) -> None:
        name, lengths, pointers, docs = (
            self.idx_path,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
        )
        if len(lengths) and lengths.min() < 0:
            raise DataError(f"{name}: negative sequence length at sequence {int(np.argmin(lengths))}")
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=starts[1:])
        bad = np.flatnonzero(pointers != starts * self.dtype.itemsize)
        if len(bad):
            raise DataError(
                f"{name}: sequence {int(bad[0])} starts at byte {int(pointers[bad[0]])}, but the "
                f"lengths before it put it at byte {int(starts[bad[0]] * self.dtype.itemsize)}"
            )
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            raise DataError(
                f"{name}: document index must rise from 0 to the sequence count {len(lengths)}, "
                f"got {len(docs)} entries starting {docs[:3].tolist()} ending {docs[-3:].tolist()}"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def max_token_id(self) -> int:
        """The largest token id in `.bin` (-1 when it holds none), so a dataset tokenized with a
        larger vocabulary than the model's is refused when it opens, not as an IndexError inside
        the embedding. Megatron's `.idx` has no room for it, so it is scanned once and cached
        beside the data, keyed by both files' sizes and modification times."""
        if len(self._data) == 0:
            return -1
        stats = [p.stat() for p in (self.idx_path, self.bin_path)]
        key = cache_key({"kind": "max_token_id", "files": [[s.st_size, s.st_mtime_ns] for s in stats]})
        path = Path(f"{self.prefix}_max_token_{key}.npy")
        arrays, _ = load_or_build({"max": path}, lambda: {"max": np.array([self._scan_max()], np.int64)})
        return int(arrays["max"][0])

    def _scan_max(self) -> int:
        chunk = 1 << 26  # tokens per read: bounded memory for the scan of a large corpus
        return max(int(self._data[i : i + chunk].max()) for i in range(0, len(self._data), chunk))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i, a view into the mapped file."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({len(self)} sequences)")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self._data[start : start + n]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


class IndexedDatasetBuilder:
    """Appends token arrays to `<prefix>.bin` and writes the `.idx` at `finalize()`.

    Both files are written under temporary names and renamed only by `finalize()`, so an
    interrupted run never leaves a half-written dataset under the final prefix.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type = np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise DataError(f"token dtype {self.dtype} has no Megatron dtype code")
        suffix = f".tmp{os.getpid()}"
        self._tmp_bin = Path(f"{data_file(prefix)}{suffix}")
        self._tmp_idx = Path(f"{index_file(prefix)}{suffix}")
        self._tmp_bin.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._num_sequences = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """One document stored as one sequence (GPT preprocessing)."""
        tokens = np.asarray(tokens).ravel()
        self.add_documents(tokens, np.array([tokens.size]))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: `tokens` concatenated, `lengths` per document.
        The batched form keeps the writer cheap enough never to be the preprocessing bottleneck."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise DataError(f"{self.prefix}: {len(tokens)} tokens given for lengths summing to {int(lengths.sum())}")
        if len(tokens) and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise DataError(f"{self.prefix}: token ids outside the range of {self.dtype.name}")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self._num_sequences += len(lengths)

    def finalize(self) -> None:
        """Writes the index, then moves both files to their final names (data first)."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.empty(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        docs = np.arange(self._num_sequences + 1, dtype=np.int64)  # one sequence per document
        try:
            with open(self._tmp_idx, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(docs)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(docs.astype("<i8").tobytes())
            os.replace(self._tmp_bin, data_file(self.prefix))
            os.replace(self._tmp_idx, index_file(self.prefix))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drops the temporary files; the final names are left untouched."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def merge_indexed_datasets(prefixes: list[str], output_prefix: str | os.PathLike[str]) -> None:
    """Concatenates datasets into one, as Megatron's merge does (`IndexedDatasetBuilder.add_index`):
    sequences and documents in the given order, byte-identical to Megatron's result.

    Streams: the `.bin` files are copied in blocks and the `.idx` arrays written one input at a
    time, so memory stays at one input's index however many inputs there are. Written under
    temporary names and renamed last, like the builder."""
    if not prefixes:
        raise DataError(f"nothing to merge into {output_prefix}")
    dtypes, n_seq, n_doc = set(), 0, 1
    for p in prefixes:
        ds = IndexedDataset(p)
        dtypes.add(ds.dtype)
        n_seq += len(ds)
        n_doc += ds.num_documents
    if len(dtypes) != 1:
        raise DataError(
            f"cannot merge datasets of different token dtypes {sorted(d.name for d in dtypes)} into {output_prefix}"
        )
    dtype = dtypes.pop()
    suffix = f".tmp{os.getpid()}"
    tmp_bin, tmp_idx = Path(f"{data_file(output_prefix)}{suffix}"), Path(f"{index_file(output_prefix)}{suffix}")
    try:
        with open(tmp_bin, "wb") as out:
            for p in prefixes:
                with open(data_file(p), "rb") as f:
                    shutil.copyfileobj(f, out, _COPY_BLOCK)
        with open(tmp_idx, "wb") as out:
            out.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[dtype], n_seq, n_doc))
            for p in prefixes:
                out.write(IndexedDataset(p).sequence_lengths.astype("<i4").tobytes())
            byte_offset = 0
            for p in prefixes:
                ds = IndexedDataset(p)
                out.write((ds.sequence_pointers + byte_offset).astype("<i8").tobytes())
                byte_offset += int(ds.sequence_lengths.sum(dtype=np.int64)) * dtype.itemsize
            out.write(np.zeros(1, "<i8").tobytes())
            seq_offset = 0
            for p in prefixes:
                ds = IndexedDataset(p)
                out.write((ds.document_indices[1:] + seq_offset).astype("<i8").tobytes())
                seq_offset += len(ds)
        os.replace(tmp_bin, data_file(output_prefix))
        os.replace(tmp_idx, index_file(output_prefix))
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
