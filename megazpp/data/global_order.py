"""One order of the training samples for a whole elastic job, whatever its islands' layouts.

Why not `PretrainingSampler`'s order: its shuffle blocks are whole global micro-steps
(micro-batch x DP ranks), so two islands with other layouts would number the same sample
differently. Here position p of the job's order depends only on the dataset's size and the
seed: the positions run through the dataset pass after pass (pass = p // total), and each pass
shuffles fixed blocks of `BLOCK_SAMPLES` with the seed, the pass and the block number. An
island reads the positions its claims name (`outer/data_plan.py`), so no two islands' claims
ever name one sample of a pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megazpp.errors import ConfigError

BLOCK_SAMPLES = 1 << 16


class GlobalOrder:
    """Sample index of each position of the job's order over a dataset of `total` samples."""

    def __init__(self, total: int, seed: int) -> None:
        if total < 1:
            raise ConfigError(f"the global sample order needs a dataset of at least 1 sample, got {total}")
        self.total, self.seed = total, seed
        self._cached: tuple[int, int, np.ndarray] | None = None  # (pass, block, its permutation)

    def _block(self, epoch: int, block: int) -> np.ndarray:
        if self._cached is None or self._cached[:2] != (epoch, block):
            size = min(BLOCK_SAMPLES, self.total - block * BLOCK_SAMPLES)
            order = block * BLOCK_SAMPLES + np.random.default_rng([self.seed, epoch, block]).permutation(size)
            self._cached = (epoch, block, order)
        return self._cached[2]

    def samples(self, positions: Sequence[int]) -> list[int]:
        """The sample indices at `positions` (each >= 0), in their order."""
        out = []
        for p in positions:
            epoch, q = divmod(int(p), self.total)
            block, offset = divmod(q, BLOCK_SAMPLES)
            out.append(int(self._block(epoch, block)[offset]))
        return out


def rank_micro_batches(batch: Sequence[int], micro_batch_size: int, dp_rank: int, dp: int) -> list[list[int]]:
    """DP rank `dp_rank`'s micro-batches of one global `batch` (whole global micro-steps of
    `micro_batch_size` x `dp` samples, rank r taking the r-th slice of each, as
    `PretrainingSampler` lays them out)."""
    step = micro_batch_size * dp
    return [
        list(batch[k + dp_rank * micro_batch_size : k + (dp_rank + 1) * micro_batch_size])
        for k in range(0, len(batch), step)
    ]
