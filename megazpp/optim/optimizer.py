"""AdamW construction shared by every engine (local, ZeRO): parameter groups and the kernel.

Weight decay is applied to matrices only: biases and norm gains (1-D tensors, or names ending
in "bias") are excluded, as in GPT-2/Megatron practice, because decaying a gain towards zero
changes the function rather than regularising it. apex's FusedAdam is used when importable
and the parameters are on CUDA (NGC images), else torch's fused (CUDA) or foreach (CPU) AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeAlias, cast

import torch
from torch import nn

from megazpp.optim.options import OptimizerOptions

# torch.optim's own type of a parameter group (its optimizers take `Iterable[dict[str, Any]]`):
# "params" a list of tensors, the rest the group's hyper-parameters.
ParamGroup: TypeAlias = dict[str, Any]


def is_decayed(name: str, param: torch.Tensor) -> bool:
    return param.dim() >= 2 and not name.endswith("bias")


def param_groups(named: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[ParamGroup]:
    """Split parameters into a decayed and a non-decayed group (empty groups are dropped)."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for name, param in named:
        (decay if is_decayed(name, param) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(groups: list[ParamGroup], cfg: OptimizerOptions) -> torch.optim.Optimizer:
    params = [p for g in groups for p in g["params"]]
    on_cuda = bool(params) and params[0].is_cuda
    lr, betas, eps = cfg.lr, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps
    if on_cuda:
        try:
            from apex.optimizers import FusedAdam
        except ImportError:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        return cast(
            torch.optim.Optimizer, FusedAdam(groups, adam_w_mode=True, lr=lr, betas=betas, eps=eps)
        )  # apex is untyped
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
