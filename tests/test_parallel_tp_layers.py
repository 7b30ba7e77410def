"""Tensor-parallel layers and mappings against their single-process twins (2 gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazpp.launch.local_ranks import run_ranks
from megazpp.parallel import comm
from megazpp.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence_parallel_region,
    get_rng_tracker,
    model_parallel_seed,
    param_is_tp_sharded,
    scatter_to_sequence_parallel_region,
    tp_partition_dim,
    vocab_parallel_cross_entropy,
)

HIDDEN, FFN, VOCAB, BATCH, SEQ = 8, 12, 16, 2, 4


def _seeded(seed: int):
    def init(w: torch.Tensor) -> None:
        w.copy_(0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)))

    return init


def _net(group, sequence_parallel: bool):
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=group, init_method=_seeded(1))
    up = ColumnParallelLinear(HIDDEN, FFN, tp_group=group, sequence_parallel=sequence_parallel, init_method=_seeded(2))
    down = RowParallelLinear(FFN, HIDDEN, tp_group=group, sequence_parallel=sequence_parallel, init_method=_seeded(3))
    with torch.no_grad():
        full_bias = torch.arange(FFN, dtype=torch.float) * 0.01
        up.bias.copy_(full_bias.chunk(comm.group_size(group) if group else 1)[comm.group_rank(group) if group else 0])
        down.bias.fill_(0.1)
    head = ColumnParallelLinear(HIDDEN, VOCAB, bias=False, tp_group=group, init_method=_seeded(4))
    return emb, up, down, head


def _run(group, sequence_parallel: bool):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    emb, up, down, head = _net(group, sequence_parallel)
    x = emb(ids)
    if sequence_parallel:
        x = scatter_to_sequence_parallel_region(x, group)
    h = down(F.gelu(up(x)))
    if sequence_parallel:
        h = gather_from_sequence_parallel_region(h, group, grad_is_partial=False)
    loss = vocab_parallel_cross_entropy(head(h), labels, group)
    loss.sum().backward()
    return loss.detach(), {
        n: (p, p.grad)
        for n, p in (
            ("emb", emb.weight),
            ("up.w", up.weight),
            ("up.b", up.bias),
            ("down.w", down.weight),
            ("down.b", down.bias),
            ("head", head.weight),
        )
    }


def _reference():
    """The same net as plain single-rank math (group None)."""
    return {sp: _run(None, False) for sp in (False, True)}


def _rank_checks():
    ref = _reference()
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    out = {}
    for sp in (False, True):
        loss, params = _run(group, sp)
        ref_loss, ref_params = ref[sp]
        out[f"loss_sp{sp}"] = (loss - ref_loss).abs().max().item()
        for name, (p, g) in params.items():
            dim = tp_partition_dim(p)
            ref_p, ref_g = ref_params[name]
            if dim is not None:
                ref_p, ref_g = ref_p.chunk(2, dim)[rank], ref_g.chunk(2, dim)[rank]
            out[f"{name}_sp{sp}_w"] = (p.detach() - ref_p).abs().max().item()
            out[f"{name}_sp{sp}_g"] = (g - ref_g).abs().max().item()
    out["sharded"] = {n: param_is_tp_sharded(p) for n, (p, _) in _run(group, False)[1].items()}
    ref_ce = F.cross_entropy(
        torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 7, 15]), reduction="none"
    )
    full = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    out["ce_vs_torch"] = (
        (vocab_parallel_cross_entropy(full.chunk(2, -1)[rank], torch.tensor([0, 7, 15]), group) - ref_ce)
        .abs()
        .max()
        .item()
    )
    model_parallel_seed(1234, tp_rank=rank)
    with get_rng_tracker().fork():
        out["tp_stream"] = torch.rand(4).tolist()
    out["default_stream"] = torch.rand(4).tolist()
    out["tp_bytes"] = comm.counter.run_totals()["intra"]
    return out


def test_tp_layers_match_single_process():
    results = run_ranks(_rank_checks, 2, timeout_s=120)
    for out in results:
        for key, value in out.items():
            if key.endswith(("_w", "_g")) or key.startswith(("loss", "ce_")):
                assert value < 1e-5, (key, value)
        assert out["sharded"] == {
            "emb": True,
            "up.w": True,
            "up.b": True,
            "down.w": True,
            "down.b": False,
            "head": True,
        }
        assert out["tp_bytes"] > 0
    assert results[0]["tp_stream"] != results[1]["tp_stream"]
    assert results[0]["default_stream"] == results[1]["default_stream"]
