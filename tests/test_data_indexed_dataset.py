"""The .bin/.idx pair: Megatron's exact byte layout, and loud failures on damaged files."""

import struct

import numpy as np
import pytest

from megazpp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megazpp.errors import DataError

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], []]


def test_index_bytes_follow_the_megatron_layout(write_token_dataset, tmp_path):
    write_token_dataset(DOCS, dtype=np.uint16)
    lengths = [3, 1, 5, 0]
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16 is code 8
        + struct.pack("<Q", 4)
        + struct.pack("<Q", 5)
        + struct.pack("<4i", *lengths)
        + struct.pack("<4q", 0, 6, 8, 18)  # byte offsets: cumulative lengths x 2 bytes
        + struct.pack("<5q", 0, 1, 2, 3, 4)
    )
    assert (tmp_path / "synthetic.idx").read_bytes() == expected
    assert (tmp_path / "synthetic.bin").read_bytes() == np.arange(5, 14, dtype="<u2").tobytes()


def test_round_trip_and_views(write_token_dataset):
    ds = IndexedDataset(write_token_dataset(DOCS))
    assert len(ds) == 4 and ds.num_documents == 4 and ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds.get(2, offset=1, length=3).tolist() == [10, 11, 12]
    assert ds.sequence_lengths.tolist() == [3, 1, 5, 0]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        ds[4]


def test_builder_writes_nothing_under_the_final_name_until_finalize(tmp_path):
    prefix = tmp_path / "out"
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    builder.add_document(np.array([1, 2, 3]))
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()
    builder.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(prefix, np.uint16) as b:
        b.add_document(np.array([1]))
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="outside the range of uint16"):
        IndexedDatasetBuilder(prefix, np.uint16).add_document(np.array([70000]))


def _damage(path, transform):
    path.write_bytes(transform(path.read_bytes()))


@pytest.mark.parametrize(
    "which, transform, message",
    [
        ("bin", lambda b: b[:-4], "truncated or mismatched pair"),
        ("bin", lambda b: b + b"\x00" * 8, "truncated or mismatched pair"),
        ("idx", lambda b: b[:-8], r"document-index entries needing \d+ bytes \(truncated\)"),
        ("idx", lambda b: b[:5], "shorter than the 34-byte index header"),
        ("idx", lambda b: b"XXIDIDX\x00\x00" + b[9:], "not a Megatron indexed-dataset index"),
        ("idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "index version 2"),
        ("idx", lambda b: b[:17] + b"\x63" + b[18:], "unknown token dtype code 99"),
        # second sequence's byte offset no longer follows the first sequence's length
        ("idx", lambda b: b[: 34 + 16 + 8] + struct.pack("<q", 4) + b[34 + 16 + 16 :], "sequence 1 starts at byte 4"),
        # document index that does not end at the sequence count
        ("idx", lambda b: b[:-8] + struct.pack("<q", 3), "document index must rise from 0"),
        ("idx", lambda b: b"", "shorter than the 34-byte index header"),
    ],
)
def test_damaged_pairs_fail_naming_the_file(write_token_dataset, tmp_path, which, transform, message):
    prefix = write_token_dataset(DOCS)
    path = tmp_path / f"synthetic.{which}"
    _damage(path, transform)
    with pytest.raises(DataError, match=message) as err:
        IndexedDataset(prefix)
    assert str(path) in str(err.value)


def test_missing_file_is_named(write_token_dataset, tmp_path):
    prefix = write_token_dataset(DOCS)
    (tmp_path / "synthetic.bin").unlink()
    with pytest.raises(DataError, match=r"synthetic\.bin does not exist"):
        IndexedDataset(prefix)


def test_merge_concatenates_in_order_and_refuses_mixed_dtypes(write_token_dataset, tmp_path):
    from megazpp.data.indexed_dataset import merge_indexed_datasets

    a = write_token_dataset(DOCS, name="a")
    b = write_token_dataset([[], [1, 2]], name="b")
    empty = write_token_dataset([], name="empty")
    merge_indexed_datasets([a, empty, b], tmp_path / "m")
    ds = IndexedDataset(tmp_path / "m")
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS + [[], [1, 2]]
    assert ds.document_indices.tolist() == list(range(7))
    with pytest.raises(DataError, match=r"different token dtypes \['int32', 'uint16'\]"):
        merge_indexed_datasets([a, write_token_dataset([[1]], name="u16", dtype=np.uint16)], tmp_path / "bad")
    with pytest.raises(DataError, match="nothing to merge"):
        merge_indexed_datasets([], tmp_path / "none")
    assert not list(tmp_path.glob("bad*")) and not list(tmp_path.glob("none*"))
