"""From a run's `DataOptions` (Megatron's `--data-path` blend and `--split`, parsed once when the
options were built) to train, valid and test datasets.

Each prefix's documents are cut into contiguous train/valid/test ranges by the split ratios;
a split then blends the matching range of every prefix by the prefix weights. Component
datasets are built with exactly the number of samples the blend draws from them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np

from megazpp.data.blended_dataset import BlendedDataset, blend_indices
from megazpp.data.gpt_dataset import GPTDataset
from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.options import DataOptions
from megazpp.errors import ConfigError, DataError

SPLIT_NAMES = ("train", "valid", "test")
GPTSamples: TypeAlias = GPTDataset | BlendedDataset  # one split's samples


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [first, last) document ranges; rounding the cumulative bounds keeps them exact."""
    bounds = np.rint(np.cumsum([0.0, *fractions]) * num_documents).astype(np.int64)
    bounds[-1] = num_documents
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def build_gpt_datasets(
    data: DataOptions,
    seq_length: int,
    num_samples: Sequence[int],
    seed: int,
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
) -> tuple[GPTSamples, GPTSamples | None, GPTSamples | None]:
    """(train, valid, test); a valid or test split with no documents or no requested samples is
    None (training samples must be asked for: a training split is never None).

    `data.blend` and `data.fractions` are used as parsed; nothing here parses them again.
    Nothing is dropped silently: a prefix without documents, or one that the split leaves with no
    training documents while training samples are asked for, is refused (a blend would
    otherwise train on the remaining prefixes alone); a blend member missing from the valid or
    test split is a warning. With `vocab_size`, a token id the model's embedding cannot hold is
    refused when the dataset opens.
    """
    if len(num_samples) != 3 or any(int(n) < 0 for n in num_samples) or int(num_samples[0]) == 0:
        raise ConfigError(
            f"num_samples must be three non-negative counts (train, valid, test), training's above 0, got {num_samples}"
        )
    blend = data.blend
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    for ds in indexed:
        _check_dataset(ds, vocab_size)
    ranges = [split_ranges(ds.num_documents, data.fractions) for ds in indexed]
    out: list[GPTSamples | None] = []
    for s, name in enumerate(SPLIT_NAMES):
        members = [i for i, r in enumerate(ranges) if r[s][1] > r[s][0]]
        if int(num_samples[s]) and len(members) < len(blend) and (name == "train" or members):
            _report_missing(name, data.split, [indexed[i] for i in range(len(blend)) if i not in members])
        if int(num_samples[s]) == 0 or not members:
            out.append(None)
            continue
        if len(blend) == 1:
            out.append(GPTDataset(indexed[0], ranges[0][s], int(num_samples[s]), seq_length, seed, name, cache_dir))
            continue
        dataset_index, sample_index = blend_indices([blend[i][0] for i in members], int(num_samples[s]))
        parts = []
        for j, i in enumerate(members):
            need = int(np.count_nonzero(dataset_index == j))
            parts.append(
                GPTDataset(indexed[i], ranges[i][s], need, seq_length, seed + i, name, cache_dir) if need else None
            )
        out.append(BlendedDataset(parts, dataset_index, sample_index))
    train, valid, test = out
    assert train is not None, "training samples were asked for, and a training split without documents is refused"
    return train, valid, test


def _check_dataset(ds: IndexedDataset, vocab_size: int | None) -> None:
    if ds.num_documents == 0:
        raise DataError(
            f"dataset {ds.prefix!r} holds no documents ({ds.idx_path}): nothing to train "
            "on; remove it from --data-path or preprocess it again"
        )
    if vocab_size is not None:
        top = ds.max_token_id()
        if top >= vocab_size:
            raise DataError(
                f"dataset {ds.prefix!r} holds token id {top}, but the model's vocabulary has "
                f"{vocab_size} entries (ids 0..{vocab_size - 1}): was it tokenized with another, "
                "larger tokenizer than --tokenizer-model?"
            )


def _report_missing(name: str, split: str, missing: Sequence[IndexedDataset]) -> None:
    """The training split must contain every prefix of the blend; a valid/test split that lacks
    some (but not all) of them is evaluated on the others, with a warning."""
    listing = ", ".join(f"{ds.prefix!r} ({ds.num_documents} documents)" for ds in missing)
    message = f"--split {split!r} leaves the {name} split no documents of {listing}"
    if name == "train":
        raise DataError(
            f"{message}: it would train without them; give a split with a larger training share or more documents"
        )
    warnings.warn(f"{message}: {name} losses are computed without them", stacklevel=3)
