"""The inner optimizer's construction shared by every engine (local, ZeRO): parameter groups
and the kernel (`build_optimizer`: AdamW or SGD, as `OptimizerOptions.name` says).

Weight decay is applied to matrices only: biases and norm gains (1-D tensors, or names ending
in "bias") are excluded, as in GPT-2/Megatron practice, because decaying a gain towards zero
changes the function rather than regularising it. apex's FusedAdam is used when importable
and the parameters are on CUDA (NGC images), else torch's fused (CUDA) or foreach (CPU) AdamW;
SGD is torch's, fused on CUDA and foreach on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeAlias, cast

import torch
from torch import nn

from megazpp.errors import CheckpointError
from megazpp.optim.options import OptimizerOptions

# torch.optim's own type of a parameter group (its optimizers take `Iterable[dict[str, Any]]`):
# "params" a list of tensors, the rest the group's hyper-parameters.
ParamGroup: TypeAlias = dict[str, Any]

OPTIMIZER_NAME_KEY = "optimizer_name"  # an engine state's key: which optimizer's state it holds


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


def build_sgd(groups: list[ParamGroup], cfg: OptimizerOptions) -> torch.optim.Optimizer:
    """torch.optim.SGD with heavy-ball momentum and the groups' weight decay coupled as L2
    (`OptimizerOptions` says why); it keeps a momentum buffer per parameter only with momentum."""
    params = [p for g in groups for p in g["params"]]
    on_cuda = bool(params) and params[0].is_cuda
    kernel = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, **kernel)


def build_optimizer(groups: list[ParamGroup], cfg: OptimizerOptions) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` names, over `groups` (`param_groups`' split, or the ZeRO
    engine's master pieces split the same way)."""
    return build_sgd(groups, cfg) if cfg.name == "sgd" else build_adamw(groups, cfg)


def check_same_optimizer(saved: object, cfg: OptimizerOptions, where: str) -> None:
    """CheckpointError unless an engine state saved by optimizer `saved` (None: saved before
    SGD existed, so AdamW) fits `cfg`: the two keep different state under different names."""
    was = saved if saved is not None else "adamw"
    if was != cfg.name:
        raise CheckpointError(
            f"{where} holds {was} optimizer state, this run's optimizer.name is {cfg.name!r}: resume it "
            f"with --optimizer {was}"
        )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
