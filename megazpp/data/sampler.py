"""Which samples each data-parallel rank reads, in which order, resumable from a checkpoint.

The sample space [0, total_samples) is walked in global micro-steps of
`micro_batch_size * dp_size` samples; rank r takes the r-th slice of each step, so ranks never
share a sample. Order is a seeded shuffle inside fixed blocks of whole steps: deterministic,
O(block) memory however long the run, and computable from `consumed_samples` alone, which is
the only state a checkpoint needs to resume exactly where it stopped. (The datasets are
already globally shuffled; the block shuffle adds a seed-controlled order on top.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from megazpp.errors import ConfigError

_BLOCK_SAMPLES = 1 << 16


class PretrainingSampler:
    """Yields lists of sample indices, one micro-batch of this DP rank each."""

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int
    ):
        if micro_batch_size < 1 or dp_size < 1:
            raise ConfigError(f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.step = micro_batch_size * dp_size
        if total_samples < self.step:
            raise ConfigError(
                f"total_samples {total_samples} is fewer than one global micro-step "
                f"(micro_batch_size {micro_batch_size} x dp_size {dp_size})"
            )
        if not 0 <= consumed_samples <= total_samples or consumed_samples % self.step:
            raise ConfigError(
                f"consumed_samples {consumed_samples} must be a multiple of {self.step} "
                f"in [0, {total_samples}] (a position saved by the same DP layout)"
            )
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        self.usable = total_samples - total_samples % self.step  # the last partial step is dropped
        self.block = self.step * max(1, _BLOCK_SAMPLES // self.step)

    def __len__(self) -> int:
        return (self.usable - self.consumed_samples) // self.step

    def _block_order(self, block_no: int) -> np.ndarray:
        start = block_no * self.block
        size = min(self.block, self.usable - start)
        return start + np.random.default_rng([self.seed, block_no]).permutation(size)

    def __iter__(self) -> Iterator[list[int]]:
        position = self.consumed_samples
        lo = self.dp_rank * self.micro_batch_size
        while position < self.usable:
            block_no = position // self.block
            order = self._block_order(block_no)
            for begin in range(position - block_no * self.block, len(order), self.step):
                yield order[begin + lo : begin + lo + self.micro_batch_size].tolist()
            position = (block_no + 1) * self.block
