"""Forward and backward over the micro-batches of one step, without pipelining.

The pipeline's 1F1B schedule (`megazpp.parallel.pipeline`) has the same signature, so the
trainer picks one or the other and nothing else changes.

Each micro-batch's loss is the mean of its per-token losses; it is divided by the number of
micro-batches before backward so the accumulated gradient is that of the mean loss over the
whole batch (micro-batches carry equal token counts), i.e. the gradient of one batch
`len(micro_batches)` times larger.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from megazpp.optim.engine_protocol import Engine

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input token ids [b, s], labels [b, s])


def forward_backward(
    model: nn.Module, micro_batches: Sequence[MicroBatch], engine: Engine, *, forward_only: bool = False
) -> list[torch.Tensor]:
    """Run every micro-batch; return each one's detached mean loss (unscaled, undivided)."""
    losses = []
    count = len(micro_batches)
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_mode:
        for tokens, labels in micro_batches:
            loss = model(tokens, labels).float().mean()
            if not forward_only:
                engine.scale_loss(loss / count).backward()
            losses.append(loss.detach())
    return losses
