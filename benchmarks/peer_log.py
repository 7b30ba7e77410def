"""The peers' per-step log (DeepSpeed's, torchft's): the console line and the TensorBoard tags
the benchmark reads from every row, written the same way for each peer so that their rows and
megazpp's compare tag for tag (`train/loss`, `perf/tokens_per_sec`, `mem/peak_bytes`)."""

from __future__ import annotations

import torch

from megazpp.config.schema import Config
from megazpp.errors import required
from megazpp.training.logger import peak_memory_bytes


class PeerLog:
    """Rank 0 prints and writes; every rank calls `step` (it reads no collective)."""

    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        self.rank, self.world, self.train_iters = rank, world, cfg.training.train_iters
        self.tokens_per_step = required(cfg.training.global_batch_size, "training.global_batch_size") * (
            cfg.model.seq_length
        )
        self.writer = None
        if rank == 0 and cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(cfg.logging.tensorboard_dir)

    def step(self, iteration: int, loss_sum: float, elapsed: float, note: str = "") -> None:
        """`loss_sum`: the ranks' mean losses summed over all ranks (one all-reduce); `note`:
        what the peer adds to the console line."""
        values = {
            "train/loss": loss_sum / self.world,
            "perf/tokens_per_sec": self.tokens_per_step / elapsed,
            "mem/peak_bytes": float(peak_memory_bytes(torch.device("cpu"))),
        }
        if self.rank != 0:
            return
        print(
            f"iter {iteration:>6}/{self.train_iters} | loss {values['train/loss']:.4f} | "
            f"tokens/s {values['perf/tokens_per_sec']:.0f}" + (f" | {note}" if note else ""),
            flush=True,
        )
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, iteration)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
