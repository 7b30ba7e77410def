"""GPTModel: GPT-2 or Llama, whole or as one pipeline stage, over the tensor-parallel layers.

Pipeline stages. `layer_range=(start, end)` builds only global layers start..end-1, kept in a
ModuleDict under their GLOBAL index, so a parameter has the same name ("layers.5.attention.
qkv.weight") in every layout: init, checkpoints and tests compare layouts by name. The first
stage (`pre_process`) owns the embedding, the last (`post_process`) the final norm, the output
layer and the loss; a middle stage maps hidden states [b, s, h] to hidden states (with
sequence parallelism, [b, s / tp, h]).

Tied embeddings (GPT-2). On a stage that is both first and last, the output layer's weight IS
the embedding's Parameter. When they live on different stages, the last stage's output layer
has its own Parameter, initialised from the embedding's name so both start equal;
`tied_embedding_weight()` returns the copy a stage holds, and the pipeline keeps the two in
sync by all-reducing their gradients over the (first, last) stage pair before each optimizer
step, as Megatron does.

MoE load-balancing loss. `forward(inputs, labels)` returns the per-token loss
    cross_entropy[b, s] + moe_aux_loss_coeff * (sum over layers of each layer's aux loss),
i.e. the same scalar is added to every token. Any average of the per-token losses whose
weights sum to one (the trainer's mean, a masked mean) is therefore "LM loss + coeff * aux",
and backward through it carries the aux gradient to every router with the trainer's own loss
scaling and micro-batch division. The detached aux sum of the last forward is in
`last_moe_aux_loss` for logging. A stage without post_process cannot add its layers' aux loss
to a loss it does not compute, so MoE with pipeline parallelism is refused unless the
coefficient is 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.init import Initializer
from megazpp.model.layer import TransformerLayer
from megazpp.model.lora import add_adapters
from megazpp.model.norm import Norm
from megazpp.model.rotary import RotaryEmbedding
from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    get_rng_tracker,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megazpp.parallel.topology import check_model_split


def _tp_rng_preserving_contexts() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """Contexts for torch.utils.checkpoint's `context_fn`.

    Checkpointing restores torch's default generator before recomputing a layer, but dropout
    inside a TP region draws from the tracker's TP-region stream, which has moved on by then;
    the recomputed mask would differ from the forward's and the gradients would be wrong. The
    forward context records the tracker's streams, the recompute context replays from them.
    """
    tracker = get_rng_tracker()
    recorded: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    @contextlib.contextmanager
    def forward_context() -> Iterator[None]:
        recorded.update(tracker.states())
        yield

    @contextlib.contextmanager
    def recompute_context() -> Iterator[None]:
        current = tracker.states()
        tracker.set_states(recorded)
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward_context(), recompute_context()


EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


class Embedding(nn.Module):
    """Token embedding (vocab-parallel), plus learned positions for GPT-2.

    Dropout is applied before the sequence-parallel scatter: every TP rank draws the same mask
    for the whole sequence and keeps its chunk, exactly the single-process mask.
    """

    def __init__(
        self, cfg: ModelConfig, init: Initializer, *, tp_group: ProcessGroup | None, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.dropout = cfg.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp_group=tp_group, init_method=init.normal(EMBEDDING_WEIGHT)
        )
        self.position_embeddings = None
        if not cfg.is_llama:
            self.position_embeddings = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            init.normal("embedding.position_embeddings.weight")(self.position_embeddings.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.word_embeddings(token_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings.weight[: token_ids.shape[1]]
        if self.dropout > 0.0:
            hidden = F.dropout(hidden, self.dropout, self.training)
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, self.tp_group)
        return hidden


class GPTModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        start, end = layer_range if layer_range is not None else (0, cfg.num_layers)
        if not 0 <= start <= end <= cfg.num_layers:
            raise ConfigError(
                f"layer_range = {layer_range!r}: expected 0 <= start <= end <= model.num_layers = {cfg.num_layers}"
            )
        if cfg.num_experts > 0 and cfg.moe_aux_loss_coeff > 0 and end > start and not post_process:
            raise ConfigError(
                "model.num_experts > 0 with pipeline parallelism: the MoE load-balancing loss of "
                "a stage without the loss head cannot reach the loss (not implemented); set "
                "model.moe_aux_loss_coeff: 0 or use one pipeline stage"
            )
        # the job's config check ran this before any rank started; a library caller gets it here
        check_model_split(
            cfg, 1 if tp_group is None else comm.group_size(tp_group), 1, sequence_parallel=sequence_parallel
        )
        self.cfg = cfg
        self.tp_group = tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_range = (start, end)
        self.last_moe_aux_loss: torch.Tensor | None = None
        init = Initializer(cfg.init_seed, cfg.init_std, cfg.num_layers)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta) if cfg.is_llama else None

        self.embedding = (
            Embedding(cfg, init, tp_group=tp_group, sequence_parallel=sequence_parallel) if pre_process else None
        )
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    cfg, f"layers.{i}", init, tp_group=tp_group, sequence_parallel=sequence_parallel, rotary=rotary
                )
                for i in range(start, end)
            }
        )
        self.final_norm = Norm(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel) if post_process else None
        self.output_layer = None
        if post_process:
            head_name = EMBEDDING_WEIGHT if cfg.tie_embeddings else "output_layer.weight"
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                bias=False,
                gather_output=False,
                tp_group=tp_group,
                sequence_parallel=sequence_parallel,
                init_method=init.normal(head_name),
            )
            if cfg.tie_embeddings and self.embedding is not None:  # a first stage
                self.output_layer.weight = self.embedding.word_embeddings.weight
        add_adapters(self, cfg)

    def tied_embedding_weight(self) -> nn.Parameter | None:
        """This stage's copy of the tied embedding/output weight, or None (untied, or a middle
        stage). On a first stage it is the embedding's weight, on a last stage the output
        layer's; on a single stage both are the same Parameter and nothing needs syncing."""
        if not self.cfg.tie_embeddings:
            return None
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        if self.output_layer is not None:
            return self.output_layer.weight
        return None

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden states (later stages) in; per-token fp32
        loss [b, s] out on the last stage when labels are given, this TP rank's vocab shard of
        the logits [b, s, vocab / tp] without labels, hidden states on other stages."""
        if self.pre_process and inputs.shape[1] > self.cfg.seq_length:
            raise ConfigError(
                f"a batch of {inputs.shape[1]} tokens per sequence is longer than "
                f"model.seq_length = {self.cfg.seq_length}"
            )
        hidden: torch.Tensor = self.embedding(inputs) if self.embedding is not None else inputs  # a first stage
        aux_terms = []
        for layer in self.layers.values():
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                hidden, aux = checkpoint(layer, hidden, use_reentrant=False, context_fn=_tp_rng_preserving_contexts)
            else:
                hidden, aux = layer(hidden)
            if aux is not None:
                aux_terms.append(aux)
        aux_total = torch.stack(aux_terms).sum() if aux_terms else None
        self.last_moe_aux_loss = aux_total.detach() if aux_total is not None else None
        if self.output_layer is None or self.final_norm is None:  # not the last stage
            return hidden
        logits: torch.Tensor = self.output_layer(self.final_norm(hidden))
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits.float(), labels, self.tp_group)
        if aux_total is not None and self.cfg.moe_aux_loss_coeff > 0:
            loss = loss + self.cfg.moe_aux_loss_coeff * aux_total
        return loss
