"""The explicit per-bucket state of the ZeRO engine.

Why a typed object: everything a bucket owns (its parameter shard, gradient accumulator,
fp32 master pieces, Adam moments and the work in flight) lives here rather than as
attributes patched onto `nn.Parameter`, so the state dict can name all of it and the
communication extensions (quantized gathers, error-feedback buffers) get one place to add
their own per-bucket tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megazpp.zero.collectives import PendingSequence
from megazpp.zero.layout import BucketLayout


@dataclass
class MasterPiece:
    """A contiguous part of the bucket's os shard with one weight-decay setting.

    `start`/`end` are relative to the os shard; `param` is the fp32 master, a leaf tensor in
    the engine's AdamW (which keeps its moments, keyed by it, in its own state).
    """

    start: int
    end: int
    decays: bool
    param: torch.Tensor


@dataclass
class Bucket:
    name: str
    layout: BucketLayout
    module: nn.Module | None
    param_store: torch.Tensor  # parameters at level p (model dtype); p = N: the full flat buffer
    grad_acc: torch.Tensor  # gradient accumulator at level g (accumulation dtype)
    masters: list[MasterPiece]
    norm_ranges: list[tuple[int, int]]  # parts of the os shard that count in the global norm
    # transient, never in checkpoints: work of the current micro-batch / step
    staging: torch.Tensor | None = None
    micro_pending: PendingSequence | None = None
    boundary_pending: PendingSequence | None = None
    full_params: torch.Tensor | None = None
    fetch_pending: PendingSequence | None = None
    arrived: set[int] = field(default_factory=set)
    launched: bool = False

    @property
    def num_params(self) -> int:
        return len(self.layout.params)
