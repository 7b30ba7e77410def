"""The `optimizer` and `precision` config sections: the inner optimizer (AdamW or SGD) with its
hyper-parameters, and the precision, checked when built.

Why here and not in the config: every engine (local, ZeRO) reads them, and optim owns them as
zero owns `ZeroOptions`. These types are the sections themselves: the config layer reads YAML
keys and flags onto their fields by name (each field's help beside it), before any rank starts;
the rules here concern one section each and name its keys. This module never imports the config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from megazpp.errors import ConfigError
from megazpp.setting import setting

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


OptimizerName = Literal["adamw", "sgd"]

# the per-parameter state tensors each optimizer keeps beside its fp32 master, by torch's names
# (what checkpoints save, resharding cuts and the memory formula counts)
ADAMW_STATE = ("exp_avg", "exp_avg_sq")
SGD_MOMENTUM_STATE = ("momentum_buffer",)
STATE_NAMES = ADAMW_STATE + SGD_MOMENTUM_STATE  # every optimizer's, as a checkpoint reader meets them


@dataclass(frozen=True)
class OptimizerOptions:
    """The inner optimizer and its hyper-parameters; `clip_grad` 0 disables clipping; `min_lr`
    is the schedule's floor.

    `name` sgd is Megatron-LM's `--optimizer sgd`: torch.optim.SGD's update with `sgd_momentum`
    (heavy ball, no dampening, no Nesterov) and `weight_decay` coupled as L2 (added to the
    gradient before the momentum, as torch.optim.SGD and Megatron do). Coupled because
    without momentum it is the same update as decay decoupled and scaled by lr (AdamW's form),
    so nothing is lost, and with momentum it keeps the step linear in gradient plus decay,
    the property that makes two-level training at H = 1 equal synchronous training
    (`tests/test_outer_anchor.py`).
    Settings of the other optimizer left at their defaults are ignored; changed ones are
    refused (they would not act).
    """

    name: OptimizerName = setting("adamw", "inner optimizer: adamw or sgd (Megatron-LM's --optimizer)")
    lr: float = setting(3.0e-4, "peak learning rate")
    min_lr: float = setting(0.0, "learning rate at the end of the decay")
    weight_decay: float = setting(
        0.01, "weight decay, not on norms and biases (adamw: decoupled; sgd: coupled L2, as torch.optim.SGD)"
    )
    adam_beta1: float = setting(0.9, "AdamW beta1 (adamw only)")
    adam_beta2: float = setting(0.95, "AdamW beta2 (adamw only)")
    adam_eps: float = setting(1.0e-8, "AdamW epsilon (adamw only)")
    sgd_momentum: float = setting(0.9, "SGD heavy-ball momentum, 0: none and no state (sgd only)")
    clip_grad: float = setting(1.0, "clip the global gradient norm to this (0: off)")

    def __post_init__(self) -> None:
        """ConfigError naming the `optimizer` key for the first value the optimizer cannot run with."""
        if self.name not in ("adamw", "sgd"):
            raise ConfigError(f"optimizer.name (--optimizer) = {self.name!r}: expected 'adamw' or 'sgd'")
        others = ("sgd_momentum",) if self.name == "adamw" else ("adam_beta1", "adam_beta2", "adam_eps")
        changed = [k for k in others if getattr(self, k) != _DEFAULTS[k]]
        if changed:
            raise ConfigError(
                f"optimizer.{changed[0]} = {getattr(self, changed[0])!r} is set, but optimizer.name is "
                f"{self.name!r}, which does not use it: leave it at {_DEFAULTS[changed[0]]!r} or choose the "
                f"other --optimizer"
            )
        if not 0 <= self.sgd_momentum < 1:
            raise ConfigError(f"optimizer.sgd_momentum = {self.sgd_momentum!r}: expected a value in [0, 1)")
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

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state tensors the optimizer keeps per parameter, each the parameter's size:
        AdamW's two moments, SGD's momentum buffer (none without momentum)."""
        if self.name == "adamw":
            return ADAMW_STATE
        return SGD_MOMENTUM_STATE if self.sgd_momentum > 0 else ()


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimizerOptions)}


@dataclass(frozen=True)
class PrecisionOptions:
    """Model dtype and, for fp16, the loss scaler (DeepSpeed's `fp16` block maps here).

    `loss_scale` 0 means dynamic: start at `initial_loss_scale`, halve on overflow (after
    `hysteresis` consecutive overflows), double after `loss_scale_window` good steps.
    `grad_accum_dtype` is the dtype micro-batch gradients are summed in under bf16/fp16.
    """

    bf16: bool = setting(False, "bf16 model with fp32 master weights")
    fp16: bool = setting(False, "fp16 model with fp32 masters and a loss scaler")
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32", "dtype micro-batch gradients are summed in (fp32 or the model's)"
    )
    loss_scale: float = setting(0.0, "fp16 static loss scale (0: dynamic)")
    initial_loss_scale: float = setting(65536.0, "fp16 dynamic scale to start from")
    min_loss_scale: float = setting(1.0, "fp16 dynamic scale floor")
    loss_scale_window: int = setting(1000, "good steps before the dynamic scale doubles")
    hysteresis: int = setting(1, "overflows in a row before the dynamic scale halves")

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
