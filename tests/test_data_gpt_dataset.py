"""GPT samples: an epoch covers every token once, windows cross documents, indices cache by content."""

import numpy as np
import pytest

from megazpp.data.gpt_dataset import GPTDataset
from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.errors import DataError


def unique_token_docs(num_docs=40, seed=0):
    """Documents of varied length (one empty) whose tokens are all distinct: 0, 1, 2, ..."""
    lengths = np.random.default_rng(seed).integers(1, 60, size=num_docs)
    lengths[7] = 0
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num_docs)]


def test_one_epoch_covers_every_token_exactly_once(write_token_dataset, tmp_path):
    docs = unique_token_docs()
    total = sum(map(len, docs))
    seq = 16
    per_epoch = (total - 1) // seq
    ds = GPTDataset(IndexedDataset(write_token_dataset(docs)), (0, len(docs)), per_epoch, seq, seed=3)
    samples = [ds[i] for i in range(len(ds))]
    assert all(s.dtype == np.int64 and len(s) == seq + 1 for s in samples)
    # the stream the samples are cut from: the documents in the dataset's shuffled order
    stream = np.concatenate([docs[d] for d in ds.document_index]).astype(np.int64)
    assert sorted(ds.document_index.tolist()) == list(range(len(docs)))
    inputs = np.concatenate([s[:-1] for s in samples])
    assert len(np.unique(inputs)) == len(inputs) == per_epoch * seq  # nothing twice
    assert set(inputs.tolist()) == set(stream[: per_epoch * seq].tolist())  # all but the final partial sample
    assert total - per_epoch * seq <= seq  # ...which is shorter than a sample
    doc_ends = np.cumsum([len(docs[d]) for d in ds.document_index])
    crossing = 0
    for i, s in enumerate(samples):
        k = int(ds.shuffle_index[i])
        assert s.tolist() == stream[k * seq : (k + 1) * seq + 1].tolist()  # contiguous across boundaries
        crossing += bool(np.any((doc_ends > k * seq) & (doc_ends <= (k + 1) * seq)))
    assert crossing > per_epoch // 3  # documents average ~30 tokens: about half the windows cross one
    assert sorted(ds.shuffle_index.tolist()) == list(range(per_epoch))
    assert ds.shuffle_index.tolist() != list(range(per_epoch))
    with pytest.raises(IndexError):
        ds[per_epoch]


def test_several_epochs_finish_one_before_the_next(write_token_dataset):
    docs = unique_token_docs(num_docs=10)
    total = sum(map(len, docs))
    seq = 8
    per_epoch = (total - 1) // seq
    ds = GPTDataset(IndexedDataset(write_token_dataset(docs)), (0, 10), 2 * per_epoch + 3, seq, seed=0)
    epochs = len(ds.document_index) // 10
    assert epochs == 3 and len(ds.document_index) == 30
    for e in range(epochs):
        assert sorted(ds.document_index[10 * e : 10 * (e + 1)].tolist()) == list(range(10))
    first_epochs = (2 * total - 1) // seq  # samples wholly inside the first two epochs come first
    assert sorted(ds.shuffle_index[:first_epochs].tolist()) == list(range(first_epochs))
    counts = np.bincount(np.concatenate([ds[i][:-1] for i in range(first_epochs)]), minlength=total)
    assert counts.max() == 2 and np.count_nonzero(counts < 2) <= seq  # twice each, but the epoch-2 tail


def test_indices_are_cached_and_rebuilt_when_inputs_change(write_token_dataset, tmp_path):
    docs = unique_token_docs()
    prefix = write_token_dataset(docs)
    first = GPTDataset(IndexedDataset(prefix), (0, 40), 50, 16, seed=1)
    assert first.built_indices and all(p.is_file() for p in first.cache_paths.values())
    assert all(p.parent == tmp_path for p in first.cache_paths.values())
    again = GPTDataset(IndexedDataset(prefix), (0, 40), 50, 16, seed=1)
    assert not again.built_indices and again.cache_paths == first.cache_paths
    assert all(np.array_equal(again[i], first[i]) for i in range(50))
    for changed in (dict(seed=2), dict(num_samples=60), dict(seq_length=15)):
        kwargs = dict(num_samples=50, seq_length=16, seed=1) | changed
        ds = GPTDataset(IndexedDataset(prefix), (0, 40), **kwargs)
        assert ds.built_indices and ds.cache_paths != first.cache_paths
    assert GPTDataset(IndexedDataset(prefix), (0, 39), 50, 16, seed=1).built_indices
    # new data under the same prefix: the lengths differ, so the old cache must not be used
    write_token_dataset(unique_token_docs(seed=9))
    rebuilt = GPTDataset(IndexedDataset(prefix), (0, 40), 50, 16, seed=1)
    assert rebuilt.built_indices and rebuilt.cache_paths != first.cache_paths
    # a damaged cache file is rebuilt, not trusted
    rebuilt.cache_paths["sample"].write_bytes(b"garbage")
    repaired = GPTDataset(IndexedDataset(prefix), (0, 40), 50, 16, seed=1)
    assert repaired.built_indices and all(np.array_equal(repaired[i], rebuilt[i]) for i in range(50))
    assert not list(tmp_path.glob("*.tmp*"))


def test_explicit_cache_dir_and_bad_arguments(write_token_dataset, tmp_path):
    prefix = write_token_dataset(unique_token_docs())
    ds = GPTDataset(IndexedDataset(prefix), (0, 40), 10, 16, seed=1, name="valid", cache_dir=tmp_path / "cache")
    assert all(p.parent == tmp_path / "cache" and "_valid_" in p.name for p in ds.cache_paths.values())
    with pytest.raises(DataError, match="document range"):
        GPTDataset(IndexedDataset(prefix), (5, 5), 10, 16, seed=1)
    with pytest.raises(DataError, match="hold no tokens"):
        GPTDataset(IndexedDataset(prefix), (7, 8), 10, 16, seed=1)


def test_real_tokenized_corpus_gives_windows_of_valid_ids(tiny_indexed_prefix, tiny_tokenizer_model):
    from megazpp.data.tokenizer import Tokenizer

    tok = Tokenizer(tiny_tokenizer_model)
    ds = GPTDataset(IndexedDataset(tiny_indexed_prefix), (0, 5), 100, 64, seed=0, cache_dir=None)
    batch = np.stack([ds[i] for i in range(100)])
    assert batch.shape == (100, 65) and batch.min() >= 0 and batch.max() < tok.vocab_size
    assert (batch == tok.eod_id).any()  # preprocessed with --append-eod, and windows cross documents
