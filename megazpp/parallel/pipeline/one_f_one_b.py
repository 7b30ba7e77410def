"""The 1F1B pipeline schedule: forward and backward over the micro-batches of one step.

Stage p of P first runs P - p - 1 warm-up forwards (filling the pipe), then alternates one
forward and one backward (steady state: at most P - p activations held, not all M), then
drains the remaining backwards. Embedding runs on the first stage, head and loss on the last.
Same calling convention as `megazpp.training.forward_backward.forward_backward`: each micro-batch's
mean loss is divided by the number of micro-batches before backward, and every rank returns
the list of per-micro-batch losses (broadcast from the last stage, so logging on any rank
reports the true loss). Tied embedding gradients are synchronised before returning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from megazpp.parallel import comm
from megazpp.parallel.pipeline.engine_protocol import PipelineEngine
from megazpp.parallel.pipeline.p2p import exchange
from megazpp.parallel.pipeline.tied import sync_tied_embedding_grads
from megazpp.parallel.topology import Topology

MicroBatch = tuple[torch.Tensor, torch.Tensor]


class _Stage:
    """One stage's forward/backward steps over micro-batches, with its boundary shapes."""

    def __init__(
        self,
        model: nn.Module,
        micro_batches: Sequence[MicroBatch],
        engine: PipelineEngine,
        topo: Topology,
        sequence_parallel: bool,
    ) -> None:
        if not micro_batches:
            raise ValueError("forward_backward_1f1b: no micro-batches to run")
        self.model, self.micro_batches, self.engine, self.topo = model, micro_batches, engine, topo
        tokens = micro_batches[0][0]
        seq = tokens.shape[1] // topo.tp if sequence_parallel else tokens.shape[1]
        param = next(model.parameters())
        # nn.Module types a sub-attribute as Tensor | Module; `model` is a GPTModel (a layer above this one)
        hidden: int = model.cfg.hidden_size  # type: ignore[union-attr, assignment]
        self.shape = (tokens.shape[0], seq, hidden)
        self.dtype, self.device = param.dtype, param.device
        self.losses: list[torch.Tensor] = []

    def forward(self, index: int, received: torch.Tensor | None) -> torch.Tensor:
        tokens, labels = self.micro_batches[index]
        if self.topo.is_last_stage:
            inputs = tokens if self.topo.is_first_stage else received
            loss: torch.Tensor = self.model(inputs, labels).float().mean()
            self.losses.append(loss.detach())
            return loss / len(self.micro_batches)
        hidden: torch.Tensor = self.model(tokens if self.topo.is_first_stage else received)
        return hidden

    def backward(
        self, received: torch.Tensor | None, output: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        if self.topo.is_last_stage:
            self.engine.scale_loss(output).backward()
        else:
            torch.autograd.backward(output, grad_tensors=grad)
        return None if received is None else received.grad

    def send_recv(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`p2p.exchange` with this stage's activation shape, dtype and device."""
        return exchange(
            self.topo,
            send_next=send_next,
            send_prev=send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            shape=self.shape,
            dtype=self.dtype,
            device=self.device,
        )


def forward_backward_1f1b(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    engine: PipelineEngine,
    *,
    topology: Topology,
    sequence_parallel: bool = False,
    forward_only: bool = False,
) -> list[torch.Tensor]:
    """Run one step's micro-batches through this pipeline stage; see module docstring."""
    topo = topology
    stage = _Stage(model, micro_batches, engine, topo, sequence_parallel)
    count = len(micro_batches)
    first, last = topo.is_first_stage, topo.is_last_stage
    warmup = count if forward_only else min(topo.pp - topo.pp_rank - 1, count)
    held: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()

    with grad_mode:
        for i in range(warmup):
            received, _ = stage.send_recv(recv_prev=not first)
            output = stage.forward(i, received)
            stage.send_recv(send_next=None if last else output.detach())
            if not forward_only:
                held.append((received, output))

        steady = count - warmup
        received = stage.send_recv(recv_prev=not first)[0] if steady else None
        for i in range(steady):
            output = stage.forward(warmup + i, received)
            _, grad = stage.send_recv(send_next=None if last else output.detach(), recv_next=not last)
            held.append((received, output))
            done_input, done_output = held.pop(0)
            input_grad = stage.backward(done_input, done_output, grad)
            more = i < steady - 1
            received, _ = stage.send_recv(send_prev=None if first else input_grad, recv_prev=more and not first)

        for _ in range(len(held)):
            done_input, done_output = held.pop(0)
            _, grad = stage.send_recv(recv_next=not last)
            input_grad = stage.backward(done_input, done_output, grad)
            stage.send_recv(send_prev=None if first else input_grad)

    if not forward_only:
        sync_tied_embedding_grads(model, topo, engine)
    return _losses_on_every_stage(stage.losses, count, topo, stage.device)


def _losses_on_every_stage(
    losses: list[torch.Tensor], count: int, topo: Topology, device: torch.device
) -> list[torch.Tensor]:
    """The last stage computed the losses; every stage returns them (one broadcast)."""
    if topo.pp == 1:
        return losses
    buf = torch.stack(losses) if topo.is_last_stage else torch.empty(count, dtype=torch.float32, device=device)
    comm.broadcast(buf, src=topo.pp_ranks[-1], group=topo.pp_group, tag="pp/losses")
    return list(buf.unbind())
