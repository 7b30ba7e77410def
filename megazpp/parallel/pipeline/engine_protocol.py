"""What the pipeline schedule needs of an optimizer engine.

Why a Protocol here: the engines (`optim.Engine`: `LocalEngine`, `ZeroEngine`) live above
`parallel` in the layers of docs/architecture.md, so the schedule cannot name them. It needs
two things: the loss scaling before each backward, and the accumulated gradient of the tied
embedding, which it sums across the first and last stage in place before `step()`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class PipelineEngine(Protocol):
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale, else itself)."""
        ...

    def grad_for(self, param: nn.Parameter) -> torch.Tensor | None:
        """The accumulated gradient `step()` will apply to `param` (None: none yet), which the
        caller may modify in place."""
        ...
