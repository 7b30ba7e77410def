"""Low-rank adapters (LoRA) for the column- and row-parallel linears, split like the layer.

LoRA adds (alpha / r) * B A to a frozen weight W (out x in): A is r x in, B is out x r. Under
tensor parallelism the adapter must give, slice for slice, what the unsplit layer's adapter
gives, so its factors are split along the dimension the layer splits:

* column-parallel (W split by output rows): B is split by rows like W; A is whole on every
  rank. Each rank's A receives only the part of the gradient that its rows of B produce, so A
  enters the product through `copy_to_tp_region` (identity forward, all-reduce of the
  gradient): every rank then holds the full, identical gradient of A;
* row-parallel (W split by input columns): A is split by columns like W, so x_r A_r^T is a
  partial sum; B is whole, and the rank's term is added to the layer's partial product before
  the layer's own reduction (one collective for both, since B is linear). B's gradient from one
  rank's partial input is partial too, hence B also enters through `copy_to_tp_region`.

A is drawn per global name (layout-independent, like every weight here) with std
1 / sqrt(in_features); B starts at zero, so a model with fresh adapters computes exactly what
the base model computes.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import mappings
from megazpp.parallel.tensor_parallel.registry import mark_tp_sharded

Split = Literal["column", "row"]


def _cut(full: torch.Tensor, dim: int, group: ProcessGroup | None) -> nn.Parameter:
    size = 1 if group is None else comm.group_size(group)
    rank = 0 if group is None else comm.group_rank(group)
    p = nn.Parameter(full.chunk(size, dim=dim)[rank].clone())
    if size > 1:
        mark_tp_sharded(p, dim)
    return p


class LowRankAdapter(nn.Module):
    """The adapter of one linear: `forward(x)` returns this rank's term of the layer's output
    (column: its output slice; row: its partial sum, to be reduced with the layer's)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        split: Split,
        tp_group: ProcessGroup | None,
        a_values: torch.Tensor,
    ) -> None:
        super().__init__()
        self.split, self.tp_group = split, tp_group
        self.scale = alpha / rank
        zeros = torch.zeros(out_features, rank, dtype=a_values.dtype, device=a_values.device)
        if split == "column":
            self.a = nn.Parameter(a_values.clone())
            self.b = _cut(zeros, 0, tp_group)
        else:
            self.a = _cut(a_values, 1, tp_group)
            self.b = nn.Parameter(zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == "column":
            low = F.linear(x, mappings.copy_to_tp_region(self.a, self.tp_group))
            return F.linear(low, self.b) * self.scale
        low = F.linear(x, self.a)
        return F.linear(low, mappings.copy_to_tp_region(self.b, self.tp_group)) * self.scale

    def delta(self) -> torch.Tensor:
        """This rank's slice of (alpha / r) B A, shaped like the layer's weight slice."""
        return (self.b @ self.a) * self.scale
