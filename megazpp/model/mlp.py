"""The two dense feed-forward blocks: GPT-2's GELU MLP and Llama's SwiGLU.

The widening projections are column-parallel and the narrowing one row-parallel, so a
tensor-parallel rank computes its slice of the hidden units end to end and only the final sum
crosses ranks. SwiGLU keeps gate and up as two separate layers (not one fused matrix) so a
column shard of each holds matching units at any TP size; the same class serves as one MoE
expert, whose three linears are what Qwen2-MoE-like models look like.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.model.init import Initializer
from megazpp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class GeluMLP(nn.Module):
    """GPT-2: fc1 -> GELU (tanh approximation, as GPT-2 was trained) -> fc2, with biases."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        name: str,
        init: Initializer,
        *,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
    ) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            hidden,
            ffn,
            bias=True,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.normal(f"{name}.fc1.weight"),
        )
        self.fc2 = RowParallelLinear(
            ffn,
            hidden,
            bias=True,
            input_is_parallel=True,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.scaled(f"{name}.fc2.weight"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        return out


class SwiGLUMLP(nn.Module):
    """Llama / one MoE expert: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        name: str,
        init: Initializer,
        *,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(
            hidden,
            ffn,
            bias=False,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.normal(f"{name}.gate_proj.weight"),
        )
        self.up_proj = ColumnParallelLinear(
            hidden,
            ffn,
            bias=False,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.normal(f"{name}.up_proj.weight"),
        )
        self.down_proj = RowParallelLinear(
            ffn,
            hidden,
            bias=False,
            input_is_parallel=True,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.scaled(f"{name}.down_proj.weight"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out
