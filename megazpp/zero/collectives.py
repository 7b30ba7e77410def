"""Run a strategy's collective sequence (from `sequences`) on a bucket's tensors.

Why an interpreter: the sequence the engine runs is the same list of `Collective`s that the
byte formulas price, so what is predicted is what is executed. A multi-stage sequence
(hierarchical) runs its first stage asynchronously and the rest when waited on, so a
bucket's reduction overlaps the remaining backward pass without a thread of our own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch.distributed import ProcessGroup

from megazpp.parallel import comm
from megazpp.zero.layout import from_dp_order, to_dp_order
from megazpp.zero.sequences import Collective


@dataclass
class ZeroGroups:
    """The process groups of a strategy: all DP ranks, my PaRO group, my column across groups
    (and, with hpZ, my secondary-partition group inside the node)."""

    dp: ProcessGroup | None
    intra: ProcessGroup | None
    cross: ProcessGroup | None
    dp_size: int
    group_size: int
    hpz: ProcessGroup | None = None  # ZeRO++ hpZ's secondary group (None: hpZ off)
    hpz_size: int = 1

    @property
    def num_groups(self) -> int:
        return self.dp_size // self.group_size

    def get(self, name: str) -> ProcessGroup | None:
        return getattr(self, name)


def size_of(groups: ZeroGroups, name: str) -> int:
    return {"dp": groups.dp_size, "intra": groups.group_size, "cross": groups.num_groups, "hpz": groups.hpz_size}[name]


class Work(Protocol):
    """An asynchronous collective's handle (`megazpp.parallel.comm` with `async_op=True`)."""

    def wait(self) -> object: ...


class _Local:
    """The work of a collective over a group of one: nothing to wait for."""

    def wait(self) -> bool:
        return True


def _start(c: Collective, t: torch.Tensor, groups: ZeroGroups, tag: str) -> tuple[Work, torch.Tensor, Callable[[], None]]:
    """Launch one collective on `t`; returns (work, result tensor, finisher run after wait).
    Over a group of one the result is `t` itself and no call is made (`traffic.step_calls`)."""
    size = size_of(groups, c.group)
    if size == 1:
        return _Local(), t, lambda: None
    group = groups.get(c.group)
    permute = c.group == "dp" and groups.group_size not in (1, groups.dp_size)
    if c.op == "all_reduce":
        return comm.all_reduce(t, group=group, async_op=True, tag=tag), t, lambda: None
    if c.op == "all_gather":
        out = torch.empty(t.numel() * size, dtype=t.dtype, device=t.device)
        if not permute:
            return comm.all_gather_into_tensor(out, t, group=group, async_op=True, tag=tag), out, lambda: None
        staged = torch.empty_like(out)
        work = comm.all_gather_into_tensor(staged, t, group=group, async_op=True, tag=tag)
        return work, out, lambda: from_dp_order(staged, out, groups.group_size, groups.num_groups)
    out = torch.empty(t.numel() // size, dtype=t.dtype, device=t.device)
    src = to_dp_order(t, groups.group_size, groups.num_groups).contiguous() if permute else t
    return comm.reduce_scatter_tensor(out, src, group=group, async_op=True, tag=tag), out, lambda: None


class PendingSequence:
    """A sequence in flight: stage 1 launched; `wait()` finishes every stage, returns the result."""

    def __init__(self, seq: list[Collective], t: torch.Tensor, groups: ZeroGroups, tag: str) -> None:
        self._rest = list(seq)
        self._groups, self._tag = groups, tag
        self._result = t
        self._work: Work | None = None
        self._finish: Callable[[], None] = lambda: None
        self._launch_next()

    def _launch_next(self) -> None:
        if self._rest:
            c = self._rest.pop(0)
            self._work, self._result, self._finish = _start(c, self._result, self._groups, self._tag)

    def wait(self) -> torch.Tensor:
        while self._work is not None:
            self._work.wait()
            self._finish()
            self._work = None
            self._launch_next()
        return self._result
