"""Column-, row- and vocab-parallel layers built only from the mappings.

Every layer materialises the FULL weight, lets `init_method` fill it in place, then keeps its
own slice. That costs one full-size temporary at construction but makes a TP model built
from a seed equal, slice for slice, to the single-process model built from the same seed:
the property the equivalence tests (and users comparing runs) rely on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import mappings
from megazpp.parallel.tensor_parallel.lora import LowRankAdapter
from megazpp.parallel.tensor_parallel.registry import mark_tp_sharded

InitMethod = Callable[[torch.Tensor], object]


def _tp_size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return comm.group_size(group), comm.group_rank(group)


def _default_linear_init(w: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))


def _sharded_parameter(
    full_shape: tuple[int, ...], dim: int, group: ProcessGroup | None, init_method: InitMethod, what: str
) -> nn.Parameter:
    size, rank = _tp_size_rank(group)
    if full_shape[dim] % size:
        raise ValueError(
            f"{what}: dimension {dim} of size {full_shape[dim]} does not divide by tensor-parallel size {size}"
        )
    full = torch.empty(full_shape)
    with torch.no_grad():
        init_method(full)
    p = nn.Parameter(full.chunk(size, dim=dim)[rank].clone())
    if size > 1:
        mark_tp_sharded(p, dim)
    return p


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output rows: each rank computes a slice of y's last dim.

    With `sequence_parallel` the input arrives split along the sequence and is all-gathered
    first (its gradient reduce-scattered back); otherwise the input is replicated and only its
    gradient is all-reduced. `gather_output` returns the full y (replicated).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output cannot be combined with sequence_parallel")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.weight = _sharded_parameter(
            (out_features, in_features), 0, tp_group, init_method or _default_linear_init, "ColumnParallelLinear"
        )
        if bias:
            self.bias = _sharded_parameter((out_features,), 0, tp_group, nn.init.zeros_, "ColumnParallelLinear bias")
        else:
            self.register_parameter("bias", None)
        self.lora: LowRankAdapter | None = None

    def add_adapter(self, rank: int, alpha: float, a_values: torch.Tensor) -> None:
        """A LoRA adapter of rank `rank` (`a_values`: the full r x in A, from the caller's init)."""
        self.lora = LowRankAdapter(self.in_features, self.out_features, rank, alpha, "column", self.tp_group, a_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tp_region(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            y = y + self.lora(x)
        return mappings.gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input columns: each rank multiplies its slice of x and
    the partial products are summed (all-reduce, or reduce-scatter over the sequence with
    `sequence_parallel`). The bias is replicated and added once, after the sum; under
    sequence parallelism its gradient is all-reduced because each rank saw other tokens.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        self.weight = _sharded_parameter(
            (out_features, in_features), 1, tp_group, init_method or _default_linear_init, "RowParallelLinear"
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("bias", None)
        self.lora: LowRankAdapter | None = None

    def add_adapter(self, rank: int, alpha: float, a_values: torch.Tensor) -> None:
        """A LoRA adapter of rank `rank` (`a_values`: the full r x in A, from the caller's init)."""
        self.lora = LowRankAdapter(self.in_features, self.out_features, rank, alpha, "row", self.tp_group, a_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tp_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.lora is not None:  # a partial sum like y: reduced with it
            y = y + self.lora(x)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
            bias = None if self.bias is None else mappings.copy_to_tp_region(self.bias, self.tp_group)
        else:
            y = mappings.reduce_from_tp_region(y, self.tp_group)
            bias = self.bias
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns, zeros the
    rest, and the partial rows are summed over TP (so the output is replicated)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: ProcessGroup | None = None,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        size, rank = _tp_size_rank(tp_group)
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.weight = _sharded_parameter(
            (num_embeddings, embedding_dim), 0, tp_group, init_method or nn.init.normal_, "VocabParallelEmbedding"
        )
        per_rank = num_embeddings // size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None or comm.group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.reduce_from_tp_region(out, self.tp_group)
