"""LayerNorm (GPT-2) and RMSNorm (Llama) that stay correct under sequence parallelism.

With sequence parallelism each TP rank normalises other tokens, so the gradient of the
(replicated) norm weight is only a partial sum on each rank. Passing the weight and bias
through `copy_to_tp_region` (identity forward, all-reduce of the gradient) completes the sum
inside backward, the way the row-parallel layer treats its bias, so no optimizer has to know
which parameters need it. Without sequence parallelism the copy is skipped (every rank saw the
same tokens and already holds the full gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.model.config import ModelConfig
from megazpp.parallel.tensor_parallel import copy_to_tp_region


class Norm(nn.Module):
    def __init__(
        self, cfg: ModelConfig, *, tp_group: ProcessGroup | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.rms = cfg.is_llama
        self.eps = cfg.norm_eps
        self.shape = (cfg.hidden_size,)
        self.grad_sync_group = tp_group if sequence_parallel else None
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp_region(self.weight, self.grad_sync_group)
        if self.bias is None:  # rms: no bias
            return F.rms_norm(x, self.shape, weight, self.eps)
        bias = copy_to_tp_region(self.bias, self.grad_sync_group)
        return F.layer_norm(x, self.shape, weight, bias, self.eps)
