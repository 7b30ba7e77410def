"""ZeRO++ communication paths: qwZ, hpZ and qgZ with LoCo, replacing the exact ones.

What changes, per path of `CommPaths`:

* parameter gather, forward (and backward without hpZ): qwZ gathers int8 codes + scales of
  the primary shard along the exact gather sequence and decodes them into the unit's buffer,
  the bucket's 1-D tensors sent exactly alongside (`quantized.ExactGather`);
* parameter gather, backward with hpZ: an all-gather of the secondary shard inside its group
  of `hpz` DP ranks on one node. The secondary shard is cut from the full buffer of the first
  forward gather after each step, so it costs no communication and backward computes with
  exactly the weights forward used (quantized ones under qwZ);
* micro-batch gradient reduction: qgZ's int4 all-to-all stages (`sequences.qgz_sequence`),
  the bucket's 1-D tensors sent exactly alongside (`quantized.ExactPlan`);
  LoCo keeps one error buffer per stage per bucket in `Bucket.extra_state` (checkpointed),
  managed across steps by `loco.LocoState` (compensation once per step, rescaled by the clip
  coefficient and loss-scale change, rolled back on a skipped step, reset every `reset_t`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import kernels
from megazpp.parallel.work import Work
from megazpp.zero import sequences, traffic
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import PendingSequence, ZeroGroups, size_of
from megazpp.zero.loco import LocoState
from megazpp.zero.paths import CommPaths
from megazpp.zero.quantized import ExactGather, ExactPlan, PendingQuantizedGather, PendingQuantizedReduce
from megazpp.zero.strategy import Strategy
from megazpp.zero.zeropp import ZeroPP


class _FillSecondary(Work[torch.Tensor]):
    """A forward gather that, once complete, leaves hpZ's secondary shard behind."""

    def __init__(
        self, pending: Work[torch.Tensor], secondary: torch.Tensor, lo: int, on_filled: Callable[[], None]
    ) -> None:
        self._pending, self._secondary, self._lo, self._on_filled = pending, secondary, lo, on_filled

    def wait(self) -> torch.Tensor:
        full = self._pending.wait()
        self._secondary.copy_(full[self._lo : self._lo + self._secondary.numel()])
        self._on_filled()
        return full

    def is_completed(self) -> bool:
        return self._pending.is_completed()


class ZeroPPPaths(CommPaths):
    """The ZeRO++ paths of one engine; `hpz_index` is my position in my hpZ group."""

    def __init__(
        self,
        strategy: Strategy,
        groups: ZeroGroups,
        hier: sequences.Hierarchy,
        shapes: sequences.DPShapes,
        zeropp: ZeroPP,
        hpz_index: int,
    ) -> None:
        super().__init__(strategy, groups, hier)
        self.zeropp = zeropp
        self._ops = kernels.kernel_set(zeropp.cpu_kernels)
        # a gather whose every stage is a group of one moves nothing: nothing to compress
        self._qwz = zeropp.qwz and any(size_of(groups, c.group) > 1 for c in self._fetch)
        self._qgz_seq = sequences.qgz_sequence(strategy, shapes, hier) if zeropp.qgz else []
        self._stages = [c.group for c in self._qgz_seq]
        self._shapes = shapes
        self._exact: dict[int, ExactPlan | None] = {}
        self._exact_gather: dict[int, ExactGather | None] = {}
        self._hpz_index = hpz_index
        self._buckets: list[Bucket] = []
        self._secondary: dict[int, torch.Tensor] = {}
        self._fresh: set[int] = set()
        self._loco = (
            LocoState([c.numel_div for c in self._qgz_seq], zeropp.qgz_block, zeropp.reset_t)
            if zeropp.loco and self._qgz_seq
            else None
        )
        self._overflow = False

    # -- per-bucket state ----------------------------------------------------------------------
    def init_bucket(self, b: Bucket) -> None:
        self._buckets.append(b)
        if self.zeropp.hpz > 1 and not b.persistent:  # a persistent bucket is never fetched
            self._secondary[id(b)] = b.param_store.new_zeros(b.layout.padded // self.zeropp.hpz)
        if self._loco is not None:
            self._loco.add_bucket(b)
        if self._qwz:
            lo, hi = b.layout.shard_range(self.strategy.params)
            self._exact_gather[id(b)] = ExactGather.build(
                b.layout.vector_ranges(),
                b.layout.padded,
                b.layout.padded // (hi - lo),
                lo // (hi - lo),
                b.param_store.device,
            )
        if self._stages:
            group, local = divmod(b.layout.dp_index, b.layout.group_size)
            position = {"intra": local, "cross": group, "dp": local * self.groups.num_groups + group}
            mine = [(size_of(self.groups, c.group), position[c.group]) for c in self._qgz_seq]
            ranges = b.layout.vector_ranges()
            widths = traffic.qgz_exact_widths(self._qgz_seq, self._shapes, b.layout.padded, ranges)
            self._exact[id(b)] = ExactPlan.build(ranges, b.layout.padded, mine, widths, b.param_store.device)

    # -- the paths -----------------------------------------------------------------------------
    def gather_calls(self, phase: str) -> int:
        return 1 if phase == "backward" and self.zeropp.hpz > 1 else super().gather_calls(phase)

    def start_param_gather(self, b: Bucket, phase: str) -> Work[torch.Tensor]:
        tag = f"zero/param_gather/{phase}"
        if phase == "backward" and id(b) in self._fresh:
            return PendingSequence(sequences.hpz_fetch_sequence(), self._secondary[id(b)], self.groups, tag)
        if self._qwz:
            pending: Work[torch.Tensor] = PendingQuantizedGather(
                self._fetch,
                b.param_store,
                self.groups,
                self.zeropp.qwz_block,
                tag,
                self._ops,
                self._exact_gather[id(b)],
            )
        else:
            pending = super().start_param_gather(b, phase)
        if self.zeropp.hpz > 1 and id(b) not in self._fresh:
            secondary = self._secondary[id(b)]
            return _FillSecondary(
                pending, secondary, self._hpz_index * secondary.numel(), lambda: self._fresh.add(id(b))
            )
        return pending

    def start_grad_reduce(self, b: Bucket, grad: torch.Tensor) -> Work[torch.Tensor]:
        if not self._stages:
            return super().start_grad_reduce(b, grad)
        loco = self._loco.for_reduction(b) if self._loco is not None else None
        pending = PendingQuantizedReduce(
            grad,
            self.groups,
            self._stages,
            self.zeropp.qgz_block,
            "zero/grad_reduce",
            loco,
            self.zeropp.err_beta,
            self._ops,
            self._exact[id(b)],
        )
        self._overflow |= pending.overflow
        return pending

    # -- notifications -------------------------------------------------------------------------
    def take_overflow(self) -> bool:
        seen, self._overflow = self._overflow, False
        return seen

    def after_step(self, skipped: bool, step_count: int, rescale: float) -> None:
        self._fresh.clear()
        if self._loco is not None:
            self._loco.after_step(skipped, step_count, rescale)

    def params_replaced(self) -> None:
        self._fresh.clear()
        if self._loco is not None:
            self._loco.commit()

    def state_nbytes(self) -> int:
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        total = sum(nbytes(t) for t in self._secondary.values())
        total += sum(nbytes(t) for b in self._buckets for t in b.extra_state.values())
        return total + (self._loco.nbytes() if self._loco is not None else 0)
