"""One pre-norm transformer layer (attention block, then feed-forward block), GPT-2 or Llama.

Both residual branches follow the same pattern x + dropout(block(norm(x))). The layer returns
(hidden, aux) where aux is the MoE load-balancing loss or None, so GPTModel can sum it over
layers whether or not a layer runs under activation checkpointing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.errors import required
from megazpp.model.attention import SelfAttention
from megazpp.model.config import ModelConfig
from megazpp.model.init import Initializer
from megazpp.model.mlp import GeluMLP, SwiGLUMLP
from megazpp.model.moe import MoEMLP
from megazpp.model.norm import Norm
from megazpp.model.rotary import RotaryEmbedding
from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import get_rng_tracker


class TransformerLayer(nn.Module):
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
        self.hidden_dropout = cfg.hidden_dropout
        # Under sequence parallelism each TP rank holds other tokens, so the residual dropout
        # masks must come from the per-rank TP-region stream; otherwise the activations are
        # replicated and the shared default stream keeps the replicas identical.
        self.sharded_tokens = sequence_parallel and tp_group is not None and comm.group_size(tp_group) > 1
        self.input_norm = Norm(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.attention = SelfAttention(
            cfg, f"{name}.attention", init, tp_group=tp_group, sequence_parallel=sequence_parallel, rotary=rotary
        )
        self.post_attention_norm = Norm(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
        if cfg.num_experts > 0:
            self.mlp: nn.Module = MoEMLP(cfg, f"{name}.mlp", init, tp_group=tp_group)
        else:
            mlp_class = SwiGLUMLP if cfg.is_llama else GeluMLP
            self.mlp = mlp_class(
                cfg.hidden_size,
                required(cfg.ffn_hidden_size, "model.ffn_hidden_size"),
                f"{name}.mlp",
                init,
                tp_group=tp_group,
                sequence_parallel=sequence_parallel,
            )
        self.is_moe = cfg.num_experts > 0

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_dropout == 0.0 or not self.training:
            return x
        rng = get_rng_tracker().fork() if self.sharded_tokens else contextlib.nullcontext()
        with rng:
            return F.dropout(x, self.hidden_dropout, True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self._dropout(self.attention(self.input_norm(x)))
        if self.is_moe:
            mlp_out, aux = self.mlp(self.post_attention_norm(x))
        else:
            mlp_out, aux = self.mlp(self.post_attention_norm(x)), None
        return x + self._dropout(mlp_out), aux
