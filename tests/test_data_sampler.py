"""The pretraining sampler: exact resumption, disjoint data-parallel shards, seeded order."""

import itertools

import numpy as np
import pytest

from megazpp.data import sampler as sampler_module
from megazpp.data.builder import build_gpt_datasets
from megazpp.data.options import DataOptions
from megazpp.data.sampler import PretrainingSampler
from megazpp.errors import ConfigError


@pytest.fixture(params=[None, 12], ids=["one-block", "block-of-12"])
def block_samples(request, monkeypatch):
    """Also run with tiny shuffle blocks, so runs and resumptions cross block boundaries."""
    if request.param:
        monkeypatch.setattr(sampler_module, "_BLOCK_SAMPLES", request.param)
    return request.param


def global_batches(total, consumed, mbs, dp, seed):
    """Per micro-step, the concatenation of every DP rank's micro-batch."""
    ranks = [PretrainingSampler(total, consumed, mbs, r, dp, seed) for r in range(dp)]
    return [sum(step, []) for step in zip(*ranks)]


def test_resuming_gives_exactly_the_uninterrupted_batches(block_samples):
    total, mbs, dp, seed = 203, 3, 2, 11
    for rank in range(dp):
        full = list(PretrainingSampler(total, 0, mbs, rank, dp, seed))
        assert len(full) == total // (mbs * dp)
        for steps_done in (1, 2, 5, 17, len(full)):
            resumed = PretrainingSampler(total, steps_done * mbs * dp, mbs, rank, dp, seed)
            assert len(resumed) == len(full) - steps_done
            assert list(resumed) == full[steps_done:]


def test_data_parallel_ranks_never_share_a_sample(block_samples):
    total, mbs, dp = 250, 4, 3
    batches = global_batches(total, 0, mbs, dp, seed=5)
    seen = list(itertools.chain.from_iterable(batches))
    usable = total - total % (mbs * dp)
    assert len(seen) == len(set(seen)) == usable and max(seen) < usable
    for step in batches:  # rank r's micro-batch is exactly slice r of the step
        assert len(step) == mbs * dp


def test_order_is_a_deterministic_function_of_the_seed(block_samples):
    a = list(PretrainingSampler(96, 0, 4, 0, 2, seed=1))
    assert a == list(PretrainingSampler(96, 0, 4, 0, 2, seed=1))
    assert a != list(PretrainingSampler(96, 0, 4, 0, 2, seed=2))
    assert sorted(itertools.chain(*global_batches(96, 0, 4, 2, 1))) == list(range(96))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(dp_rank=2), "dp_rank 2 is outside"),
        (dict(consumed_samples=6), "multiple of 8"),
        (dict(consumed_samples=128), "multiple of 8"),
        (dict(total_samples=7), "fewer than one global micro-step"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, message):
    args = dict(total_samples=100, consumed_samples=0, micro_batch_size=4, dp_rank=0, dp_size=2, seed=0) | kwargs
    with pytest.raises(ConfigError, match=message):
        PretrainingSampler(**args)


def test_sampler_drives_the_dataset(tiny_indexed_prefix):
    train = build_gpt_datasets(DataOptions([tiny_indexed_prefix], "1,0,0"), 32, (64, 0, 0), seed=0)[0]
    rank0 = [np.stack([train[i] for i in batch]) for batch in PretrainingSampler(64, 16, 4, 0, 2, seed=3)]
    assert len(rank0) == 6 and all(b.shape == (4, 33) for b in rank0)
