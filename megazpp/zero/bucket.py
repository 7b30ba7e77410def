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

from megazpp.errors import CheckpointError
from megazpp.parallel.work import Work
from megazpp.state import StateDict
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
    modules: list[nn.Module]  # unit roots whose hooks fetch this bucket (p sharded)
    param_store: torch.Tensor  # parameters at level p (model dtype); p = N: the full flat buffer
    grad_acc: torch.Tensor  # gradient accumulator at level g (accumulation dtype)
    masters: list[MasterPiece]
    norm_ranges: list[tuple[int, int, int]]  # (layout index, start, end): os-shard parts in the norm
    # parameters below stage3_param_persistence_threshold: whole on every rank (p = N), never fetched
    persistent: bool = False
    # state a communication path keeps per bucket (e.g. error feedback); checkpointed
    extra_state: dict[str, torch.Tensor] = field(default_factory=dict)
    # transient, never in checkpoints: work of the current micro-batch / step
    staging: torch.Tensor | None = None
    sent: torch.Tensor | None = None  # staging the reduction in flight runs in (back to the pool after it)
    micro_pending: Work[torch.Tensor] | None = None  # work in flight: `wait()` gives its result
    boundary_pending: Work[torch.Tensor] | None = None
    full_params: torch.Tensor | None = None
    fetch_pending: Work[torch.Tensor] | None = None
    arrived: set[int] = field(default_factory=set)
    launched: bool = False

    @property
    def num_params(self) -> int:
        return len(self.layout.params)

    @property
    def frozen(self) -> bool:
        """A group of frozen parameters (`zero/frozen.py`): a parameter shard and no gradients."""
        return self.grad_acc.numel() == 0

    def state_dict(self) -> StateDict:
        return {
            "name": self.name,
            "padded": self.layout.padded,
            "param_store": self.param_store.clone(),
            "grad_acc": self.grad_acc.clone(),
            "masters": [m.param.detach().clone() for m in self.masters],
            "extra_state": {k: v.clone() for k, v in self.extra_state.items()},
        }

    def load_state_dict(self, saved: StateDict) -> None:
        if saved["name"] != self.name or saved["padded"] != self.layout.padded:
            raise CheckpointError(
                f"ZeRO checkpoint bucket {saved['name']} ({saved['padded']} "
                f"elements) does not match {self.name} ({self.layout.padded})"
            )
        if set(saved["extra_state"]) != set(self.extra_state):
            raise CheckpointError(
                f"ZeRO checkpoint bucket {self.name} holds path state "
                f"{sorted(saved['extra_state'])}, this run keeps {sorted(self.extra_state)}"
            )
        with torch.no_grad():
            self.param_store.copy_(saved["param_store"])
            self.grad_acc.copy_(saved["grad_acc"])
            for m, master in zip(self.masters, saved["masters"]):
                m.param.copy_(master)
            for k, v in saved["extra_state"].items():
                self.extra_state[k].copy_(v)
