"""Megatron-LM's `.bin/.idx` files and ours are the same format: each side reads what the
other writes, and for the same documents both writers produce the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install megatron-core to run this interop test)"
)
from megatron.core.datasets import indexed_dataset as mcore  # noqa: E402

from megazpp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def _documents(dtype: np.dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 70_000)
    return [rng.integers(0, high, size=n).astype(dtype) for n in (5, 1, 17, 300, 2, 64)]


def _write_megatron(prefix: str, docs: list[np.ndarray], dtype: np.dtype, split_last: bool = False) -> None:
    """One sequence per document (GPT preprocessing); with `split_last`, the last document
    is two sequences (Megatron's sentence-split mode), which exercises the document index."""
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, doc in enumerate(docs):
        if split_last and i == len(docs) - 1:
            builder.add_item(torch.from_numpy(doc[:10].astype(np.int64)))
            builder.add_item(torch.from_numpy(doc[10:].astype(np.int64)))
        else:
            builder.add_item(torch.from_numpy(doc.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _write_ours(prefix: str, docs: list[np.ndarray], dtype: np.dtype) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            builder.add_document(doc)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_written_reads_identically_here(tmp_path, dtype):
    docs = _documents(np.dtype(dtype))
    _write_megatron(str(tmp_path / "mcore"), docs, dtype, split_last=True)
    ours, theirs = IndexedDataset(tmp_path / "mcore"), mcore.IndexedDataset(str(tmp_path / "mcore"))
    assert ours.dtype == np.dtype(dtype)
    assert len(ours) == len(theirs) == len(docs) + 1
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    assert ours.document_indices.tolist() == list(range(len(docs))) + [len(docs) + 1]
    for i in range(len(ours)):
        assert np.array_equal(ours[i], theirs[i])
    assert np.array_equal(np.concatenate([ours[len(docs) - 1], ours[len(docs)]]), docs[-1])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_ours_read_identically_by_megatron_and_bytes_match(tmp_path, dtype):
    docs = _documents(np.dtype(dtype))
    _write_ours(str(tmp_path / "ours"), docs, dtype)
    theirs = mcore.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    assert np.array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert np.array_equal(theirs[i], doc)
        if len(doc) > 2:
            assert np.array_equal(theirs.get(i, offset=1, length=2), doc[1:3])
    _write_megatron(str(tmp_path / "mcore"), docs, dtype)
    for suffix in (".bin", ".idx"):
        ours, theirs = tmp_path / f"ours{suffix}", tmp_path / f"mcore{suffix}"
        assert ours.read_bytes() == theirs.read_bytes()


def test_merged_preprocessing_reads_identically_in_megatron_and_matches_its_merge(tmp_path, tiny_tokenizer_model):
    """Many files preprocessed into shards and merged: megatron-core reads every token of the
    merged dataset as our shards hold it, and its own merge of the same shards gives the same bytes."""
    import json

    from megazpp.preprocess.pipeline import preprocess

    for f in range(5):
        path = tmp_path / "in" / f"s{f % 2}" / f"{f}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": f"file {f} doc {d} " + "abc " * d}) + "\n" for d in range(f + 1)))
    shards = preprocess(
        tmp_path / "in", tiny_tokenizer_model, tmp_path / "shard", per_shard=True, append_eod=True, progress=False
    ).shard_outputs["text"]
    merged = preprocess(
        tmp_path / "in", tiny_tokenizer_model, tmp_path / "merged", append_eod=True, progress=False
    ).outputs["text"]
    expected = [IndexedDataset(p)[i] for p in shards for i in range(len(IndexedDataset(p)))]
    theirs = mcore.IndexedDataset(merged)
    assert len(theirs) == len(expected) == 15
    assert np.array_equal(theirs.document_indices, np.arange(16))
    for i, doc in enumerate(expected):
        assert np.array_equal(theirs[i], doc)
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "mcore_merge.bin"), dtype=np.uint16)
    for p in shards:
        builder.add_index(p)
    builder.finalize(str(tmp_path / "mcore_merge.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"mcore_merge{suffix}").read_bytes() == open(merged + suffix, "rb").read()
