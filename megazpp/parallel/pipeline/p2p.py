"""Activation and gradient exchange between neighbouring pipeline stages.

Every exchange posts all its sends and receives in one batch before waiting, so the two
sides of a stage boundary, which run conjugate exchanges at the same point of the schedule
(send activations + receive gradients / send gradients + receive activations), cannot
deadlock on the order of blocking calls.
"""

from __future__ import annotations

import torch

from megazpp.parallel import comm
from megazpp.parallel.topology import Topology


def _peer(rank: int | None, which: str) -> int:
    """The global rank of the neighbouring stage; the first stage has no previous, the last no next."""
    if rank is None:
        raise ValueError(f"pipeline exchange with the {which} stage, which this stage does not have")
    return rank


def exchange(
    topo: Topology,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    shape: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send/receive with the neighbours; returns (from_prev, from_next) where requested.

    `from_prev` (an activation) requires grad, so backward can hand its gradient upstream.
    """
    ops = []
    from_prev = from_next = None
    if send_next is not None:
        ops.append(comm.send_op(send_next.contiguous(), _peer(topo.next_stage_rank, "next"), topo.pp_group))
    if send_prev is not None:
        ops.append(comm.send_op(send_prev.contiguous(), _peer(topo.prev_stage_rank, "previous"), topo.pp_group))
    if recv_prev:
        from_prev = torch.empty(shape, dtype=dtype, device=device)
        ops.append(comm.recv_op(from_prev, _peer(topo.prev_stage_rank, "previous"), topo.pp_group))
    if recv_next:
        from_next = torch.empty(shape, dtype=dtype, device=device)
        ops.append(comm.recv_op(from_next, _peer(topo.next_stage_rank, "next"), topo.pp_group))
    for work in comm.batch_isend_irecv(ops, tag="pp/p2p"):
        work.wait()
    if from_prev is not None:
        from_prev.requires_grad_(True)
    return from_prev, from_next
