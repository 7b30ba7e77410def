"""`LocalEngine`, one data-parallel rank holding whole gradients:
- fp32: the optimizer (AdamW or SGD, `optim.optimizer.build_optimizer`) directly on the
  model's parameters.
- bf16 / fp16: the model runs in half precision; the optimizer updates fp32 master copies and
  writes them back, rounded, into the model after each step. Micro-batch gradients are summed
  into fp32 buffers as each parameter's gradient completes (a post-accumulate hook), so long
  gradient accumulation does not lose the small contributions half precision would round
  away (`grad_accum_dtype` "fp32"); with the model dtype they are summed by autograd instead.
- fp16 adds a loss scaler (`loss_scaler.LossScaler`): overflowing steps are skipped.
A step whose gradient norm is not finite is never applied, in any precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from megazpp.errors import CheckpointError
from megazpp.optim.engine_protocol import ScaledOptimizerEngine, StepResult
from megazpp.optim.grad_norm import clip_by_norm_, global_grad_norm
from megazpp.optim.loss_scaler import scaler_for
from megazpp.optim.optimizer import (
    OPTIMIZER_NAME_KEY,
    build_optimizer,
    check_same_optimizer,
    named_trainable,
    param_groups,
)
from megazpp.optim.options import OptimizerOptions, PrecisionOptions


class LocalEngine(ScaledOptimizerEngine):
    """The engine for one data-parallel rank (DP = 1), under any TP x PP layout.

    `norm_groups`: process groups whose ranks' gradients together form the model (TP, PP), so
    the clipping norm is global. `counts_in_norm(name, param)` says whether this rank counts a
    parameter's gradient in that norm (a TP-replicated tensor only on one TP rank).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerOptions,
        precision: PrecisionOptions,
        *,
        norm_groups: Sequence[ProcessGroup] = (),
        counts_in_norm: Callable[[str, nn.Parameter], bool] | None = None,
    ) -> None:
        named = named_trainable(model)
        self.params: list[torch.Tensor] = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.dtype = precision.model_dtype
        self.clip_grad = optimizer.clip_grad
        self.norm_groups = tuple(norm_groups)
        self._counted = [counts_in_norm is None or counts_in_norm(n, p) for n, p in named]
        self._mixed = self.dtype != torch.float32
        if self._mixed:
            self.masters = [p.detach().clone().float() for p in self.params]
            model.to(self.dtype)
        else:
            self.masters = self.params
        names = [n for n, _ in named]
        self.optimizer_options = optimizer
        self.optimizer = build_optimizer(param_groups(zip(names, self.masters), optimizer.weight_decay), optimizer)
        self._fp32_accum = self._mixed and precision.grad_accum_dtype == "fp32"
        self._main_grads: list[torch.Tensor] = []
        self._touched: list[bool] = []
        self._hooks: list[RemovableHandle] = []
        if self._fp32_accum:
            self._main_grads = [torch.zeros_like(m) for m in self.masters]
            self._touched = [False] * len(self.params)
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._accumulate_hook(i)) for i, p in enumerate(self.params)
            ]
        self.scaler = scaler_for(precision)

    def _accumulate_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                raise RuntimeError("the gradient-accumulation hook ran for a parameter without a gradient")
            self._main_grads[index].add_(param.grad)
            self._touched[index] = True
            param.grad = None

        return hook

    def grad_for(self, param: nn.Parameter) -> torch.Tensor | None:
        """The accumulated gradient `step()` will apply to `param`, for code that must reduce
        it in place first (the pipeline's tied-embedding sync): the fp32 accumulator under
        fp32 accumulation, else `param.grad`."""
        if not self._fp32_accum:
            return param.grad
        index = self._index[id(param)]
        return self._main_grads[index] if self._touched[index] else None

    def _master_grads(self) -> list[tuple[int, torch.Tensor]]:
        """Attach this step's fp32 gradient to each master that received one."""
        out = []
        for i, (param, master) in enumerate(zip(self.params, self.masters)):
            if self._fp32_accum:
                grad = self._main_grads[i] if self._touched[i] else None
            elif param.grad is not None:
                grad = param.grad if not self._mixed else param.grad.float()
            else:
                grad = None
            if grad is not None:
                master.grad = grad
                out.append((i, grad))
        return out

    def step(self) -> StepResult:
        indexed = self._master_grads()
        grads = [g for _, g in indexed]
        if self.scaler is not None and grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        device = self.masters[0].device if self.masters else "cpu"
        norm = float(global_grad_norm([g for i, g in indexed if self._counted[i]], self.norm_groups, device))
        finite = math.isfinite(norm)
        if finite:
            clip_by_norm_(grads, norm, self.clip_grad)
            self.optimizer.step()
            if self._mixed:
                with torch.no_grad():
                    torch._foreach_copy_(self.params, self.masters)
        self.zero_grad()
        if self.scaler is not None:
            self.scaler.update(overflow=not finite)
        return StepResult(grad_norm=norm, skipped=not finite, loss_scale=self.loss_scale)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self._mixed:
            for m in self.masters:
                m.grad = None
        for g in self._main_grads:
            g.zero_()
        self._touched = [False] * len(self._touched)

    def close(self) -> None:
        """Remove the fp32-accumulation hooks (nothing is in flight between steps here)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def state_dict(self, *, frozen: bool = True) -> dict[str, Any]:
        """Optimizer, fp32 masters and loss scale of the trainable parameters; the frozen
        ones live in the model only, so `frozen` leaves nothing out here."""
        return {
            "optimizer": self.optimizer.state_dict(),
            OPTIMIZER_NAME_KEY: self.optimizer_options.name,
            "masters": [m.detach().clone() for m in self.masters] if self._mixed else None,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_optimizer(state.get(OPTIMIZER_NAME_KEY), self.optimizer_options, "engine state")
        masters = state.get("masters")
        if self._mixed != (masters is not None) or (self.scaler is None) != (state.get("loss_scaler") is None):
            raise CheckpointError(
                "engine state was saved with a different precision setting "
                f"(this run: {self.dtype}, fp16 scaler: {self.scaler is not None})"
            )
        if masters is not None:
            if len(masters) != len(self.masters) or any(a.shape != b.shape for a, b in zip(masters, self.masters)):
                raise CheckpointError(
                    "engine state: fp32 master weights do not match the model's parameters (different model shape?)"
                )
            with torch.no_grad():
                torch._foreach_copy_(self.masters, masters)
                torch._foreach_copy_(self.params, self.masters)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
