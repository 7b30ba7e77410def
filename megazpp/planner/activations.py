"""Activation memory of one rank: Megatron's per-layer estimate (Korthikanti et al., 2022).

Why this estimate and not a measurement: the planner must answer before a run exists, and the
estimate is what Megatron users size jobs with. It counts 16-bit activations kept for the
backward pass of one transformer layer with s tokens, micro-batch b, hidden h, a heads:

    no tensor parallelism          s b h (34 + 5 a s / h)
    TP = t                         s b h (10 + 24 / t + 5 a s / (h t))
    TP = t, sequence parallelism   s b h (34 + 5 a s / h) / t

The 5 a s / h term is the attention score matrix and its softmax / dropout masks; a fused
("flash") attention kernel, which torch's scaled_dot_product_attention uses on GPUs, never
stores them, so `flash_attention` drops it. Under full activation checkpointing a layer keeps
only its input (2 s b h, divided by t under sequence parallelism) and one layer's full set
lives during its recomputation. The constants were derived for GPT (4h MLP, one K/V head per
query head); for SwiGLU / grouped-query attention they are an estimate of the same order.

Pipeline (1F1B): stage i of P keeps min(P - i, A) micro-batches in flight; the last stage
also holds the fp32 logits and their gradient (2 x 4 s b V / t bytes).
"""

from __future__ import annotations

from megazpp.model.config import ModelConfig


def layer_bytes(cfg: ModelConfig, micro_batch: int, tp: int, sequence_parallel: bool, flash_attention: bool) -> float:
    """Bytes one layer keeps for backward, per micro-batch, without checkpointing."""
    s, b, h, a = cfg.seq_length, micro_batch, cfg.hidden_size, cfg.num_attention_heads
    scores = 0.0 if flash_attention else 5 * a * s / h
    if tp == 1:
        return s * b * h * (34 + scores)
    if sequence_parallel:
        return s * b * h * (34 + scores) / tp
    return s * b * h * (10 + 24 / tp + scores / tp)


def stage_activation_bytes(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    micro_batches: int,
    tp: int,
    pp: int,
    stage: int,
    layers: int,
    sequence_parallel: bool,
    flash_attention: bool,
    checkpointing: bool,
) -> float:
    """Peak activation bytes of one rank of pipeline stage `stage`."""
    s, b, h = cfg.seq_length, micro_batch, cfg.hidden_size
    in_flight = min(pp - stage, micro_batches)
    full = layer_bytes(cfg, micro_batch, tp, sequence_parallel, flash_attention)
    if checkpointing:
        kept = 2 * s * b * h / (tp if sequence_parallel else 1)
        total = in_flight * layers * kept + full
    else:
        total = in_flight * layers * full
    if stage == pp - 1:
        total += 2 * 4 * s * b * cfg.vocab_size / tp
    return total
