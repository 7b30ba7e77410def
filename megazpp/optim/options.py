"""The optimizer's options: AdamW's hyper-parameters and the precision, typed and checked once,
when built.

Why here and not in the config: every engine (local, ZeRO) reads them, and optim owns them as
zero owns `ZeroOptions`, the code that uses them beside them. The config layer maps its `optimizer` and
`precision` sections onto these types by field name (`megazpp.config.options.options_of`)
before any rank starts; the rules here concern one section each and name its keys. This module
never imports the config schema: the config's sections take their defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megazpp.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW hyper-parameters; `clip_grad` 0 disables clipping; `min_lr` is the schedule's floor."""

    lr: float = 3.0e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        """ConfigError naming the `optimizer` key for the first value AdamW cannot run with."""
        if not self.lr > 0:
            raise ConfigError(
                f"optimizer.lr (--lr) = {self.lr:g}: expected a learning rate > 0 (a negative "
                "one would climb the loss; 0 would not train)"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optimizer.min_lr = {self.min_lr} must lie in [0, optimizer.lr = {self.lr}]")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optimizer.{key} = {getattr(self, key)}: expected a value in [0, 1)")
        if not self.adam_eps > 0:
            raise ConfigError(f"optimizer.adam_eps = {self.adam_eps!r}: expected a value > 0")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError(
                "optimizer.weight_decay and optimizer.clip_grad must be >= 0, "
                f"got {self.weight_decay} and {self.clip_grad}"
            )


@dataclass(frozen=True)
class PrecisionOptions:
    """Model dtype and, for fp16, the loss scaler (DeepSpeed's `fp16` block maps here).

    `loss_scale` 0 means dynamic: start at `initial_loss_scale`, halve on overflow (after
    `hysteresis` consecutive overflows), double after `loss_scale_window` good steps.
    `grad_accum_dtype` is the dtype micro-batch gradients are summed in under bf16/fp16.
    """

    bf16: bool = False
    fp16: bool = False
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = 0.0
    initial_loss_scale: float = 65536.0
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 1

    def __post_init__(self) -> None:
        """ConfigError naming the `precision` key for the first inconsistent value."""
        if self.bf16 and self.fp16:
            raise ConfigError("precision.bf16 and precision.fp16 are both set: choose one")
        model = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        if self.grad_accum_dtype not in ("fp32", model):
            raise ConfigError(
                f"precision.grad_accum_dtype = {self.grad_accum_dtype!r} with a {model} model: "
                f"expected 'fp32' or the model dtype {model!r}"
            )
        if self.loss_scale < 0:
            raise ConfigError(f"precision.loss_scale = {self.loss_scale}: expected 0 (dynamic) or > 0")
        for key in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"precision.{key} = {getattr(self, key)!r}: expected a value > 0")

    @property
    def model_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def accum_dtype(self) -> torch.dtype:
        return DTYPES[self.grad_accum_dtype]
