"""GPTModel at TP=2 (2 gloo ranks) equals the single-process model: loss, every parameter
shard and every gradient shard, for GQA Llama, GPT-2 (tied), MoE, with and without sequence
parallelism. This checks the model's side of TP: the grouped qkv layout, local head counts,
the norm-gradient sync under sequence parallelism and the tied output layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazpp.errors import TopologyError
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.parallel.tensor_parallel import param_is_tp_sharded, tp_partition_dim

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8, init_std=0.1)
CASES = [
    ("llama_gqa", dict(arch="llama", num_query_groups=2, **BASE), False),
    ("llama_gqa_sp", dict(arch="llama", num_query_groups=2, **BASE), True),
    ("gpt2", dict(arch="gpt2", **BASE), False),
    ("gpt2_sp", dict(arch="gpt2", **BASE), True),
    ("llama_moe", dict(arch="llama", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8, **BASE), False),
]


def _shard(full: torch.Tensor, p: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return full.chunk(size, dim=tp_partition_dim(p))[rank] if param_is_tp_sharded(p) else full


def _compare_on_rank() -> dict[str, float]:
    """Max abs difference to the single-process model, per case (loss, params, grads)."""
    group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    worst = {}
    for name, kwargs, sequence_parallel in CASES:
        cfg = ModelConfig(**kwargs)
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        ref = GPTModel(cfg)
        ref_loss = ref(inputs, labels)
        ref_loss.mean().backward()
        model = GPTModel(cfg, tp_group=group, sequence_parallel=sequence_parallel)
        loss = model(inputs, labels)
        loss.mean().backward()
        diffs = [(loss - ref_loss).abs().max().item()]
        ref_params = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            full = ref_params[pname]
            diffs.append((p - _shard(full, p, rank, size)).abs().max().item())
            diffs.append((p.grad - _shard(full.grad, p, rank, size)).abs().max().item())
        with torch.no_grad():
            local_logits = model(inputs)
            full_logits = ref(inputs)
        assert local_logits.shape[-1] == cfg.vocab_size // size
        diffs.append((local_logits - full_logits.chunk(size, -1)[rank]).abs().max().item())
        worst[name] = max(diffs)
    for bad, key in ((dict(num_query_groups=1), "num_query_groups = 1"), (dict(vocab_size=63), "vocab_size = 63")):
        try:
            GPTModel(ModelConfig(**{**CASES[0][1], **bad}), tp_group=group)
        except TopologyError as e:
            assert key in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted at TP={size}")
    return worst


def test_tp2_equals_single_process():
    for worst in run_ranks(_compare_on_rank, 2, timeout_s=120):
        for name, diff in worst.items():
            assert diff < 1e-5, (name, diff)
