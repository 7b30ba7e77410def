"""Megatron-style --data-path blends and --split ranges."""

import numpy as np
import pytest

from megazpp.data.blended_dataset import blend_indices
from megazpp.data.builder import build_gpt_datasets, split_ranges
from megazpp.data.options import DataOptions, parse_data_path, parse_split
from megazpp.errors import ConfigError, DataError


def numbered_docs(first_token, num_docs=50, doc_len=20):
    return [list(range(first_token + d * doc_len, first_token + (d + 1) * doc_len)) for d in range(num_docs)]


def test_blend_of_0_7_and_0_3_draws_those_proportions(write_token_dataset):
    a = write_token_dataset(numbered_docs(0), name="a")  # tokens 0..999
    b = write_token_dataset(numbered_docs(1000), name="b")  # tokens 1000..1999
    train, valid, test = build_gpt_datasets(DataOptions(["0.7", a, "0.3", b], "100,0,0"), 32, (10_000, 5, 5), seed=7)
    assert valid is None and test is None and len(train) == 10_000
    from_a = 0
    for i in range(len(train)):
        sample = train[i]
        assert sample.shape == (33,) and sample.dtype == np.int64
        assert (sample < 1000).all() or (sample >= 1000).all()  # each sample comes from one prefix
        from_a += int(sample[0] < 1000)
    assert abs(from_a / 10_000 - 0.7) < 0.01
    # the blend needs many epochs of these small prefixes; every window stays valid
    assert len(train.datasets[0]) + len(train.datasets[1]) == 10_000


def test_blend_index_tracks_the_weights_at_every_prefix():
    rng = np.random.default_rng(0)
    for weights in [[2.0, 1.0, 1.0], [0.7, 0.3]] + [rng.random(int(k)) + 0.01 for k in rng.integers(2, 9, 40)]:
        w = np.asarray(weights) / np.sum(weights)
        dataset_index, sample_index = blend_indices(weights, 4000)
        counts = np.stack([np.cumsum(dataset_index == d) for d in range(len(w))], axis=1)
        assert np.abs(counts - np.outer(np.arange(1, 4001), w)).max() <= 2
        for d in range(len(w)):  # each component is read in order 0, 1, 2, ...
            assert sample_index[dataset_index == d].tolist() == list(range(int(counts[-1, d])))
    dataset_index, _ = blend_indices([0.7, 0.3], 10)
    # virtual times: A at 0.71 2.14 3.57 5.0 6.43 7.86 9.29, B at 1.67 5.0 8.33
    assert dataset_index.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["0.7", "A", "0.3"], "every prefix needs exactly one weight"),
        (["0.7", "A", "B"], "every prefix needs exactly one weight"),
        (["A", "0.3"], "every prefix needs exactly one weight"),
        (["0.5", "0.5"], "every prefix needs exactly one weight"),
        (["-1", "A", "2", "B"], "weights must be positive"),
        (["0", "A", "1", "B"], "weights must be positive"),
        ([], "data path is empty"),
    ],
)
def test_weights_that_do_not_match_the_prefixes_fail(data_path, message):
    with pytest.raises(DataError, match=message):
        parse_data_path(data_path)


def test_unweighted_prefixes_share_equally_and_missing_prefix_is_named(tmp_path):
    assert parse_data_path(["A", "B"]) == [(0.5, "A"), (0.5, "B")]
    assert parse_data_path(["0.7", "A", "0.3", "B"]) == [(0.7, "A"), (0.3, "B")]
    with pytest.raises(DataError, match=r"nowhere\.idx does not exist"):
        build_gpt_datasets(DataOptions(["1", str(tmp_path / "nowhere")], "1,0,0"), 8, (10, 0, 0), seed=0)


def test_split_969_30_1_gives_contiguous_disjoint_document_ranges(write_token_dataset):
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(21, parse_split("969,30,1")) == [(0, 20), (20, 21), (21, 21)]
    for bad in ("a,b,c", "1,2,3,4", "0,0,0", "-1,2,0"):
        with pytest.raises(ConfigError, match="split"):
            parse_split(bad)
    prefix = write_token_dataset(numbered_docs(0, num_docs=100, doc_len=10))
    train, valid, test = build_gpt_datasets(DataOptions([prefix], "80,10,10"), 16, (200, 20, 20), seed=0)
    for ds, (lo, hi) in ((train, (0, 800)), (valid, (800, 900)), (test, (900, 1000))):
        tokens = np.concatenate([ds[i] for i in range(len(ds))])
        assert tokens.min() >= lo and tokens.max() < hi  # documents of 10 tokens: doc d holds 10d..10d+9
    assert build_gpt_datasets(DataOptions([prefix], "100,0,0"), 16, (10, 10, 10), seed=0)[1:] == (None, None)
    with pytest.raises(ConfigError, match="num_samples"):
        build_gpt_datasets(DataOptions([prefix], "1,0,0"), 16, (10, 10), seed=0)


def test_builder_on_the_shared_tiny_prefix(tiny_indexed_prefix):
    from megazpp.data.indexed_dataset import IndexedDataset

    ranges = split_ranges(IndexedDataset(tiny_indexed_prefix).num_documents, parse_split("969,30,1"))
    train, valid, test = build_gpt_datasets(DataOptions([tiny_indexed_prefix], "969,30,1"), 64, (40, 4, 4), seed=1234)
    assert ranges[2][0] == ranges[2][1] and test is None  # a few dozen documents leave 0.1% empty
    assert len(train) == 40 and len(valid) == 4
    again = build_gpt_datasets(DataOptions([tiny_indexed_prefix], "969,30,1"), 64, (40, 4, 4), seed=1234)[0]
    assert not again.built_indices
    assert all(np.array_equal(train[i], again[i]) for i in range(40))


def test_data_options_parse_once_and_the_builder_takes_them_as_parsed(write_token_dataset):
    """The `data` section is parsed and checked once, into the run's DataOptions; the builder
    takes the parsed blend and split and never parses the text again."""
    from megazpp.config.checks import check_config
    from megazpp.config.load import load_config

    with pytest.raises(ConfigError, match=r"data\.split = '0,0,0': the weights sum to zero"):
        DataOptions(["A"], "0,0,0")
    with pytest.raises(DataError, match="every prefix needs exactly one weight"):
        DataOptions(["0.7", "A", "0.3"])
    with pytest.raises(ConfigError, match=r"data\.make_vocab_size_divisible_by = 0"):
        DataOptions(make_vocab_size_divisible_by=0)
    a = write_token_dataset(numbered_docs(0, num_docs=100, doc_len=10), name="a")
    b = write_token_dataset(numbered_docs(1000, num_docs=100, doc_len=10), name="b")
    with pytest.raises(DataError, match="weights must be positive"):
        check_config(load_config(["--data-path", "0", a, "1", b]))
    data = check_config(load_config(["--data-path", "3", a, "1", b, "--split", "8/2"])).data
    assert data.blend == ((3.0, a), (1.0, b)) and data.fractions == (0.8, 0.2, 0.0)
    # text no parser accepts beside the parsed values: a builder that parsed again would fail
    object.__setattr__(data, "data_path", ("0.5", "0.5"))
    object.__setattr__(data, "split", "not a split")
    train, valid, test = build_gpt_datasets(data, 16, (40, 8, 0), seed=0)
    assert len(train) == 40 and len(valid) == 8 and test is None
    for i in range(8):  # the valid split holds documents 80..99 of each prefix: tokens 800..999, 1800..1999
        assert ((valid[i] >= 800) & (valid[i] < 1000)).all() or ((valid[i] >= 1800) & (valid[i] < 2000)).all()
