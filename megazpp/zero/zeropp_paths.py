"""ZeRO++ communication paths: qwZ, hpZ and qgZ with LoCo, replacing the exact ones.

What changes, per path of `CommPaths`:

* parameter gather, forward (and backward without hpZ): qwZ gathers int8 codes + scales of
  the primary shard along the exact gather sequence and decodes them into the unit's buffer;
* parameter gather, backward with hpZ: an all-gather of the secondary shard inside its group
  of `hpz` DP ranks on one node. The secondary shard is cut from the full buffer of the first
  forward gather after each step, so it costs no communication and backward computes with
  exactly the weights forward used (quantized ones under qwZ);
* micro-batch gradient reduction: qgZ's int4 all-to-all stages (`formulas.qgz_sequence`);
  LoCo keeps one error buffer per stage per bucket in `Bucket.extra_state` (checkpointed).

LoCo and skipped steps: the buffers are updated while reducing, before anybody knows whether
the step will be skipped, so in fp16 runs (where overflow skips are routine) the buffers of
the last completed step are kept aside and put back on a skip; a loss-scale change rescales
them (errors are in loss-scaled units); every `reset_t` completed steps they are zeroed. In
bf16 / fp32 a skip means a diverging run, and the second copy would cost a byte per parameter,
so there the buffers keep what the skipped step's reductions wrote.
"""

from __future__ import annotations

from typing import Callable

import torch

import kernels
from megazpp.zero import formulas
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import PendingSequence, ZeroGroups, size_of
from megazpp.zero.paths import CommPaths, Waitable
from megazpp.zero.quantized import PendingQuantizedGather, PendingQuantizedReduce
from megazpp.zero.strategy import Strategy


class _FillSecondary:
    """A forward gather that, once complete, leaves hpZ's secondary shard behind."""

    def __init__(self, pending: Waitable, secondary: torch.Tensor, lo: int,
                 on_filled: Callable[[], None]) -> None:
        self._pending, self._secondary, self._lo, self._on_filled = pending, secondary, lo, on_filled

    def wait(self) -> torch.Tensor:
        full = self._pending.wait()
        self._secondary.copy_(full[self._lo:self._lo + self._secondary.numel()])
        self._on_filled()
        return full


class ZeroPPPaths(CommPaths):
    """The ZeRO++ paths of one engine; `hpz_index` is my position in my hpZ group;
    `skip_copy`: keep LoCo's buffers of the last completed step to restore on a skipped step
    (fp16 runs, where overflow skips are routine)."""

    def __init__(self, strategy: Strategy, groups: ZeroGroups, hier: formulas.Hierarchy,
                 shapes: formulas.DPShapes, zeropp: formulas.ZeroPP, hpz_index: int,
                 skip_copy: bool) -> None:
        super().__init__(strategy, groups, hier)
        self.zeropp = zeropp
        self._ops = kernels.kernel_set(zeropp.cpu_kernels)
        self._skip_copy = skip_copy
        # a gather whose every stage is a group of one moves nothing: nothing to compress
        self._qwz = zeropp.qwz and any(size_of(groups, c.group) > 1 for c in self._fetch)
        self._qgz_seq = formulas.qgz_sequence(strategy, shapes) if zeropp.qgz else []
        self._stages = [(groups.get(c.group), size_of(groups, c.group)) for c in self._qgz_seq]
        self._hpz_index = hpz_index
        self._buckets: list[Bucket] = []
        self._secondary: dict[int, torch.Tensor] = {}
        self._fresh: set[int] = set()
        self._committed: dict[int, dict[str, torch.Tensor]] = {}
        self._overflow = False

    # -- per-bucket state ----------------------------------------------------------------------
    def init_bucket(self, b: Bucket) -> None:
        self._buckets.append(b)
        if self.zeropp.hpz > 1:
            self._secondary[id(b)] = b.param_store.new_zeros(b.layout.padded // self.zeropp.hpz)
        if self.zeropp.loco:
            for i, c in enumerate(self._qgz_seq, start=1):
                codes, scales = kernels.new_error_buffer(b.layout.padded // c.numel_div, self.zeropp.qgz_block,
                                                         b.param_store.device)
                b.extra_state[f"loco_stage{i}_codes"] = codes
                b.extra_state[f"loco_stage{i}_scales"] = scales
            if self._skip_copy:
                self._committed[id(b)] = {k: v.clone() for k, v in b.extra_state.items()}

    def _loco_buffers(self, b: Bucket) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if not self.zeropp.loco:
            return None
        return [(b.extra_state[f"loco_stage{i}_codes"], b.extra_state[f"loco_stage{i}_scales"])
                for i in range(1, len(self._qgz_seq) + 1)]

    # -- the paths -----------------------------------------------------------------------------
    def gather_calls(self, phase: str) -> int:
        return 1 if phase == "backward" and self.zeropp.hpz > 1 else super().gather_calls(phase)

    def start_param_gather(self, b: Bucket, phase: str) -> Waitable:
        tag = f"zero/param_gather/{phase}"
        if phase == "backward" and id(b) in self._fresh:
            return PendingSequence(formulas.hpz_fetch_sequence(), self._secondary[id(b)], self.groups, tag)
        if self._qwz:
            pending: Waitable = PendingQuantizedGather(self._fetch, b.param_store, self.groups,
                                                       self.zeropp.qwz_block, tag, self._ops)
        else:
            pending = super().start_param_gather(b, phase)
        if self.zeropp.hpz > 1 and id(b) not in self._fresh:
            secondary = self._secondary[id(b)]
            return _FillSecondary(pending, secondary, self._hpz_index * secondary.numel(),
                                  lambda: self._fresh.add(id(b)))
        return pending

    def start_grad_reduce(self, b: Bucket, grad: torch.Tensor) -> Waitable:
        if not self._stages:
            return super().start_grad_reduce(b, grad)
        pending = PendingQuantizedReduce(grad, self._stages, self.zeropp.qgz_block, "zero/grad_reduce",
                                         self._loco_buffers(b), self.zeropp.err_beta, self._ops)
        self._overflow |= pending.overflow
        return pending

    # -- notifications -------------------------------------------------------------------------
    def take_overflow(self) -> bool:
        seen, self._overflow = self._overflow, False
        return seen

    def after_step(self, skipped: bool, step_count: int, scale_ratio: float) -> None:
        self._fresh.clear()
        for b in self._buckets:
            live, saved = b.extra_state, self._committed.get(id(b))
            if skipped and saved is not None:
                for k, v in saved.items():
                    live[k].copy_(v)
            elif not skipped and step_count % self.zeropp.reset_t == 0:
                for v in live.values():
                    v.zero_()
            if scale_ratio != 1.0:
                for k, v in live.items():
                    if k.endswith("_scales"):
                        v.mul_(scale_ratio)
            if saved is not None:
                for k, v in live.items():
                    saved[k].copy_(v)

    def params_replaced(self) -> None:
        self._fresh.clear()
        for b in self._buckets:
            for k, v in self._committed.get(id(b), {}).items():
                v.copy_(b.extra_state[k])

    def state_nbytes(self) -> int:
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()
        total = sum(nbytes(t) for t in self._secondary.values())
        for b in self._buckets:
            total += sum(nbytes(t) for t in b.extra_state.values())
            total += sum(nbytes(t) for t in self._committed.get(id(b), {}).values())
        return total
