"""Causal self-attention with grouped-query heads, split over tensor-parallel ranks.

q, k and v come out of ONE column-parallel projection whose output rows are ordered per query
group: [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...]. A contiguous
column shard then holds whole groups (query groups divide by the TP size), so each rank
attends with its own heads and no reshuffle is needed; it is also one matmul instead of three.
The output projection is row-parallel and sums the ranks' partial results.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.errors import required
from megazpp.model.config import ModelConfig
from megazpp.model.init import Initializer
from megazpp.model.rotary import RotaryEmbedding
from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_rng_tracker


class SelfAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        name: str,
        init: Initializer,
        *,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
        rotary: RotaryEmbedding | None,
    ) -> None:
        super().__init__()
        tp = 1 if tp_group is None else comm.group_size(tp_group)
        self.sharded = tp > 1
        self.head_dim = cfg.head_dim
        self.local_heads = cfg.num_attention_heads // tp
        groups = required(cfg.num_query_groups, "model.num_query_groups")
        self.local_groups = groups // tp
        self.heads_per_group = cfg.num_attention_heads // groups
        self.dropout = cfg.attention_dropout
        self.rotary = rotary
        qkv_size = (cfg.num_attention_heads + 2 * groups) * cfg.head_dim
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            qkv_size,
            bias=cfg.use_bias,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.normal(f"{name}.qkv.weight"),
        )
        self.out = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=cfg.use_bias,
            input_is_parallel=True,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            init_method=init.scaled(f"{name}.out.weight"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, local (heads + 2 groups) * head_dim]; s is the full sequence
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_groups, self.heads_per_group + 2, self.head_dim)
        # split (not indexing) so backward is one concatenation, not a zero-filled copy per piece
        qk, v = qkv.split([self.heads_per_group + 1, 1], dim=3)
        if self.rotary is not None:
            qk = self.rotary.apply(qk)  # q and k of every group rotated in one pass
        q, k = qk.split([self.heads_per_group, 1], dim=3)
        q = q.reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # [b, heads, s, d]
        k = k.reshape(b, s, self.local_groups, self.head_dim).transpose(1, 2)
        v = v.reshape(b, s, self.local_groups, self.head_dim).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        # Each TP rank holds other heads, so their dropout masks must differ: draw them from
        # the per-rank TP-region stream.
        rng = get_rng_tracker().fork() if dropout > 0 and self.sharded else contextlib.nullcontext()
        with rng:
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=self.local_groups != self.local_heads
            )
        out: torch.Tensor = self.out(context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        return out
