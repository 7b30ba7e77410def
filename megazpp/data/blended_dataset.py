"""Several datasets mixed by weight (Megatron's `--data-path 0.7 A 0.3 B`).

Sample i goes to the dataset that is furthest behind its target share after i + 1 draws
(largest `weight * (i + 1) - drawn_so_far`). The mix is deterministic, needs no random
numbers, and every prefix of the sequence is within one sample of the exact proportions,
so even a short run sees the requested blend.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megazpp.errors import DataError


def blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, index of that sample inside its dataset), each of length `size`."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"blend weights must be positive finite numbers, got {list(weights)}")
    w = w / w.sum()
    dataset_index = np.empty(size, dtype=np.int16 if len(w) < 2**15 else np.int32)
    sample_index = np.empty(size, dtype=np.int64)
    drawn = np.zeros(len(w), dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(w * (i + 1) - drawn))
        dataset_index[i] = d
        sample_index[i] = drawn[d]
        drawn[d] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """`ds[i]` is sample `sample_index[i]` of dataset `dataset_index[i]`."""

    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, sample_index: np.ndarray):
        self.datasets = list(datasets)
        self.dataset_index = dataset_index
        self.sample_index = sample_index
        for d, ds in enumerate(self.datasets):
            need = int(np.count_nonzero(dataset_index == d))
            if need and (ds is None or len(ds) < need):
                raise DataError(f"blend component {d} has {0 if ds is None else len(ds)} samples, {need} needed")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a blend of {len(self)} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
