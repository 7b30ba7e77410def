"""LoCo's error-feedback buffers across optimizer steps: in the units of the applied update.

Why this is its own object: the buffers are written while gradients are reduced, before the
step knows its global norm, whether it will be skipped, or how the fp16 loss scale moves. Left
alone they would hold residuals in units the optimizer never applied: a clipped spike's
residual replayed at full weight for ~1/(1 - err_beta) steps (Adam's second moment inflates
and the run does not recover), or a skipped step's residuals drained into the next one. So:

* compensation runs once per optimizer step per bucket: the first micro-batch's reduction
  adds the buffer and writes the new residual; later micro-batches of the step quantize
  without feedback (the LoCo author's Megatron code compensates once per step, on the
  accumulated gradient; here gradients are reduced per micro-batch, and one compensation per
  step keeps the buffer's decay by err_beta per optimizer step, as in the paper);
* after a completed step every buffer is multiplied by the step's `rescale` (the clip
  coefficient times the loss scale's change), which turns the residual of what was sent into
  the residual of what was applied, in the next step's gradient units (one fused
  `_foreach_mul_`);
* a skipped step (non-finite norm on any rank, any precision) puts the buffers back to their
  values after the last completed step (a committed copy, refreshed by one fused
  `_foreach_copy_` per step), rescaled for the loss scale's change;
* every `reset_t` completed steps they are zeroed (the paper's periodic reset).

The buffers are fp32, one value per element (DeepSpeed keeps them in the gradient dtype), not
the LoCo paper's 8-bit codes: with int8 codes per block, a coordinate whose per-step increment
(1 - err_beta) g stays below half the buffer block's step (its largest residual / 127) is
rounded back to the same code every step, so the small gradients int4 zeroes are never
accumulated either (docs/benchmarks.md, the LoCo experiment).
"""

from __future__ import annotations

import torch

import kernels
from megazpp.zero.bucket import Bucket

Buffers = list[torch.Tensor]  # one fp32 error buffer per qgZ stage


class LocoState:
    """The error buffers of every bucket for `stage_divs` qgZ stages (stage i covers
    P / stage_divs[i] elements of a bucket of P), kept in `Bucket.extra_state`."""

    def __init__(self, stage_divs: list[int], block: int, reset_t: int) -> None:
        self._divs, self._block, self._reset_t = list(stage_divs), block, reset_t
        self._buffers: dict[int, Buffers] = {}
        self._live: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []
        self._compensated: set[int] = set()

    def add_bucket(self, b: Bucket) -> None:
        buffers = []
        for i, div in enumerate(self._divs, start=1):
            err = kernels.new_error_buffer(b.layout.padded // div, self._block, b.param_store.device)
            b.extra_state[f"loco_stage{i}_error"] = err
            buffers.append(err)
            self._live.append(err)
            self._saved.append(err.clone())
        self._buffers[id(b)] = buffers

    def for_reduction(self, b: Bucket) -> Buffers | None:
        """The buffers the reduction of `b` starting now compensates with: those of `b` on the
        step's first reduction of it, None (no feedback) on later micro-batches."""
        if id(b) in self._compensated:
            return None
        self._compensated.add(id(b))
        return self._buffers[id(b)]

    def after_step(self, skipped: bool, step_count: int, rescale: float) -> None:
        self._compensated.clear()
        if skipped:
            torch._foreach_copy_(self._live, self._saved)
        elif step_count % self._reset_t == 0:
            torch._foreach_zero_(self._live)
        if rescale != 1.0:
            torch._foreach_mul_(self._live, rescale)
        self.commit()

    def commit(self) -> None:
        """The live buffers become what a skipped step restores (after a step, a checkpoint load)."""
        self._compensated.clear()
        torch._foreach_copy_(self._saved, self._live)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._saved)
