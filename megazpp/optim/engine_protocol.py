"""The optimizer-engine protocol the trainer talks to, and what every engine shares.

Why a protocol: the trainer's loop must not care whether gradients are reduced over data
parallel ranks, sharded (ZeRO/PaRO), quantized on the wire or kept whole. It only scales the
loss, asks for a step and checkpoints the engine's state; each engine owns everything else
(masters, moments, accumulators, the loss scaler) and saves it in its own state dict.
`grad_for` hands the pipeline the accumulated tied-embedding gradient to sum across stages
(`parallel.pipeline.PipelineEngine`, the part of this protocol the pipeline may name).
`close` ends the engine after the last step: it finishes what is still in flight and removes
the hooks it put on the model. A hook on a parameter is held by autograd's C++ side, which
Python's garbage collector cannot see, so without `close` the engine, the model and every
process group they hold would live until the interpreter exits, and gloo's worker threads
with them (`launch.local_ranks.release_process_groups` says why that aborts a finished
run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from megazpp.optim.loss_scaler import LossScaler
from megazpp.optim.optimizer import set_lr


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: the global gradient norm before clipping (after
    unscaling), whether the update was skipped, and the loss scale for the next step."""

    grad_norm: float
    skipped: bool
    loss_scale: float
    scalars: dict[str, float] = field(default_factory=dict)  # more to log this step (outer syncs)


class Engine(Protocol):
    """What the trainer and the schedules call; see module docstring."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def set_lr(self, lr: float) -> None: ...

    def step(self) -> StepResult: ...

    def zero_grad(self) -> None: ...

    def state_dict(self, *, frozen: bool = True) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def grad_for(self, param: nn.Parameter) -> torch.Tensor | None: ...

    def close(self) -> None: ...


class ScaledOptimizerEngine:
    """What every engine shares: an fp16 loss scaler (None outside fp16) and the optimizer whose
    learning rate the trainer sets each step. Subclasses assign `scaler` and `optimizer`."""

    scaler: LossScaler | None
    optimizer: torch.optim.Optimizer

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler else loss

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
