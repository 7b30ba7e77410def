"""Run a strategy's collective sequence (from `sequences`) on a bucket's tensors.

Why an interpreter: the sequence the engine runs is the same list of `Collective`s that the
byte formulas price, so what is predicted is what is executed.

Why `StageOrder`: a multi-stage sequence (hierarchical) launches its first stage
asynchronously; each later stage needs the previous one's result, and should start as soon as
that result is there, not when someone waits for the whole sequence. gloo matches collectives
on a group by the order ranks issue them, and "the previous stage has completed" is seen at
different moments on different ranks, so later stages run on groups of their own
(`ZeroGroups.later`: the same ranks, never used for a first stage) and, on each such group, in
the order their sequences were launched (reserved at launch, which every rank does in the same
order). Whoever looks first issues them: the engine's progress points (`StageOrder.progress`,
called from the module and gradient hooks) for stages whose predecessor has completed, or a
`wait()`, which first issues what is queued ahead of it on the same group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from megazpp.errors import ConfigError
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.parallel.work import Work
from megazpp.zero.buffers import BufferPool
from megazpp.zero.layout import dp_pieces
from megazpp.zero.sequences import Collective, DPShapes, dp_shapes


class StagedWork(Work[torch.Tensor], ABC):
    """A chain of collectives, stage j + 1 computed from stage j's result; stage 0 is issued on
    construction (`_begin`), later ones through the `StageOrder` on `ZeroGroups.later` groups.
    A `Work[torch.Tensor]`: a subclass's `wait()` finishes every stage and gives the result.

    A subclass says how a stage is issued (`_issue(j, group)` -> the work) and what follows its
    completion (`_complete(j)`: unpack, reduce, prepare the next stage's input)."""

    def __init__(self, groups: ZeroGroups, names: list[str]) -> None:
        self._groups, self._names = groups, names
        self._next = 0
        self._work: Work[object] | None = None
        for name in names[1:]:
            groups.order.reserve(self, name)

    @abstractmethod
    def _issue(self, j: int, group: ProcessGroup | None) -> Work[object]: ...

    @abstractmethod
    def _complete(self, j: int) -> None: ...

    def _begin(self) -> None:
        if self._names:
            self._work = self._issue(0, self._groups.get(self._names[0]))
            self._next = 1

    def next_group(self) -> str | None:
        """The group name of the stage to issue next (None: every stage is issued)."""
        return self._names[self._next] if self._next < len(self._names) else None

    def current_done(self) -> bool:
        """Whether the stage in flight has completed (a local look: differs between ranks)."""
        return self._work is not None and self._work.is_completed()

    def is_completed(self) -> bool:
        """Every stage issued and the last one complete (a local look, as `current_done`)."""
        return self.next_group() is None and (self._work is None or self._work.is_completed())

    def step(self) -> None:
        """Finish the stage in flight and issue the next, after whatever is queued ahead of it
        on that stage's group."""
        name = self._names[self._next]
        self._groups.order.clear_way(self, name)
        if self._work is None:
            raise RuntimeError(f"{type(self).__name__}.step: no stage in flight to finish")
        self._work.wait()
        self._complete(self._next - 1)
        self._work = self._issue(self._next, self._groups.later[name])
        self._next += 1
        self._groups.order.issued(self, name)

    def _finish_all(self) -> None:
        while self.next_group() is not None:
            self.step()
        if self._work is not None:
            self._work.wait()
            self._complete(self._next - 1)
            self._work = None


class StageOrder:
    """The later stages of staged works, queued per group in launch order."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[StagedWork]] = {}

    def reserve(self, work: StagedWork, name: str) -> None:
        self._queues.setdefault(name, deque()).append(work)

    def clear_way(self, work: StagedWork, name: str) -> None:
        """Issue every stage queued on `name` ahead of `work`'s (waiting for what each follows).
        Everything ahead was launched earlier, so this never comes back to `work`."""
        queue = self._queues[name]
        while queue[0] is not work:
            queue[0].step()

    def issued(self, work: StagedWork, name: str) -> None:
        first = self._queues[name].popleft()
        assert first is work, "a later stage was issued out of its group's launch order"

    def progress(self) -> int:
        """Issue each queued stage whose predecessor has completed and nothing is ahead of it;
        returns how many were issued. Cheap when nothing is queued (a progress point)."""
        issued, moved = 0, True
        while moved:
            moved = False
            for name, queue in self._queues.items():
                while queue and queue[0].next_group() == name and queue[0].current_done():
                    queue[0].step()
                    issued, moved = issued + 1, True
        return issued


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
    # groups over the same ranks as "intra" / "cross" that carry only later stages (StageOrder)
    later: dict[str, ProcessGroup | None] = field(default_factory=dict)
    order: StageOrder = field(default_factory=StageOrder)
    buffers: BufferPool = field(default_factory=BufferPool)  # gather outputs, staging: kept for reuse

    @property
    def num_groups(self) -> int:
        return self.dp_size // self.group_size

    def get(self, name: str) -> ProcessGroup | None:
        group: ProcessGroup | None = getattr(self, name)  # a field of this class, by name
        return group


def zero_groups(topo: Topology, k: int | None, h: int) -> tuple[ZeroGroups, DPShapes]:
    """The groups of PaRO group size `k` (None: the DP ranks on this node) and hpZ group size
    `h`, with their shapes. Collective: every rank calls it with the same sizes."""
    d = topo.dp
    if k is None:
        k = max(1, sum(1 for r in topo.dp_ranks if topo.node_of(r) == topo.node))
    if k < 1 or d % k:
        raise ConfigError(f"zero.paro_group_size = {k}: expected a positive divisor of the data-parallel size {d}")
    intra = topo.dp_subgroup(k)[1]
    cross = topo.dp_cross_subgroup(k)[1]
    hpz = topo.dp_subgroup(h)[1] if h > 1 else None
    later = {}  # the groups of later stages (StageOrder), where there are two stages
    if 1 < k < d:
        later = {"intra": topo.dp_subgroup(k, copy=1)[1], "cross": topo.dp_cross_subgroup(k, copy=1)[1]}
    shapes = dp_shapes(topo.dp_ranks, k, topo.rank, topo.ranks_per_node, h, comm.backend())
    return ZeroGroups(topo.dp_group, intra, cross, d, k, hpz, h, later), shapes


def size_of(groups: ZeroGroups, name: str) -> int:
    return {"dp": groups.dp_size, "intra": groups.group_size, "cross": groups.num_groups, "hpz": groups.hpz_size}[name]


def _parts(flat: torch.Tensor, groups: ZeroGroups, name: str) -> list[torch.Tensor]:
    """Views of `flat` by member of group `name`, in group-rank order: on the whole DP group
    (with 1 < k < D) out of buffer order (`layout.dp_pieces`), else its chunks."""
    if name == "dp" and groups.group_size not in (1, groups.dp_size):
        return dp_pieces(flat, groups.group_size, groups.num_groups)
    return list(flat.view(-1).chunk(size_of(groups, name)))


def _start(
    c: Collective, t: torch.Tensor, groups: ZeroGroups, group: ProcessGroup | None, tag: str, out: torch.Tensor | None
) -> tuple[Work[object], torch.Tensor]:
    """Launch one collective on `t` over `group` (of the size of `c.group`); returns (work,
    result). An all-gather writes into `out` (required); a reduce-scatter or all-reduce works in
    place, so `t` is given up (its result is a view of it)."""
    if c.op == "all_reduce":
        return comm.all_reduce(t, group=group, async_op=True, tag=tag), t
    if c.op == "all_gather":
        assert out is not None, "an all-gather needs its output buffer"
        return comm.all_gather_into_parts(_parts(out, groups, c.group), t, group=group, async_op=True, tag=tag), out
    parts = _parts(t, groups, c.group)
    return comm.reduce_scatter_parts(t, parts, group=group, tag=tag), parts[comm.group_rank(group)]


class PendingSequence(StagedWork):
    """A sequence in flight: stage 1 launched, later stages as soon as a progress point sees
    their predecessor done (or on `wait()`), which returns the result. A collective over a
    group of one is skipped: no call, its input is its result (`traffic.step_calls`).

    The sequence consumes its input: reductions run in place on it (the result of a sequence
    of reductions is a view of `t`). Every all-gather's output comes from `groups.buffers`; an
    intermediate one goes back there once the stage reading it has completed, the final one is
    the caller's (to hand back to the pool when done with it)."""

    def __init__(self, seq: list[Collective], t: torch.Tensor, groups: ZeroGroups, tag: str) -> None:
        self._seq = [c for c in seq if size_of(groups, c.group) > 1]
        super().__init__(groups, [c.group for c in self._seq])
        self._tag = tag
        self._result = t
        self._reads: torch.Tensor | None = None  # an earlier gather's output the stage in flight reads
        self._begin()

    def _issue(self, j: int, group: ProcessGroup | None) -> Work[object]:
        c, inp = self._seq[j], self._result
        out = None
        if c.op == "all_gather":
            out = self._groups.buffers.take(inp.numel() * size_of(self._groups, c.group), inp)
            self._reads = inp if j > 0 and self._seq[j - 1].op == "all_gather" else None
        work, self._result = _start(c, inp, self._groups, group, self._tag, out)
        return work

    def _complete(self, j: int) -> None:
        """Stage j is done: the intermediate gather output it read is free again."""
        if self._reads is not None:
            self._groups.buffers.give(self._reads)
            self._reads = None

    def wait(self) -> torch.Tensor:
        self._finish_all()
        return self._result
