"""TP, PP, TP x PP and DP x TP training equals the single-process model (fp32, 5 steps),
for GPT-2 (tied embeddings) and Llama (GQA, untied): losses, gradients, gradient norms
(clipping is active, so a wrong norm would change the updates) and final weights.

DP gradient reduction: the layouts whose gradients are compared reduce them with a plain
all-reduce through `comm` before `LocalEngine.step()` (the gradients stay visible in
`param.grad`); DP2 x TP2 is also trained with the ZeRO engine's NNN strategy (plain DDP),
whose gradients live in its buckets, so there losses, norms and final weights are compared.
"""

from __future__ import annotations

import torch

from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import EMBEDDING_WEIGHT, GPTModel
from megazpp.optim.local_engine import LocalEngine
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel import comm
from megazpp.parallel.pipeline import counts_in_norm, forward_backward_1f1b
from megazpp.parallel.tensor_parallel import tp_partition_dim
from megazpp.parallel.topology import Topology, check_model_split
from megazpp.training.forward_backward import forward_backward
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zero_engine import ZeroEngine

STEPS, MICRO, MICRO_BATCH, SEQ = 5, 2, 2, 8
GRAD_STEPS = (0, STEPS - 1)
TOL = 1e-5


def _cfg(arch: str) -> ModelConfig:
    extra = {"num_query_groups": 2} if arch == "llama" else {}
    return ModelConfig(
        arch=arch,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=SEQ,
        init_seed=7,
        **extra,
    )


def _global_micro_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        x = torch.randint(0, 64, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _optimizer() -> OptimizerOptions:
    """adam_eps is large on purpose: Adam divides by sqrt(v) + eps, so for an element whose
    gradient is ~0 a summation-order difference of 1e-7 (TP/DP sums run in another order)
    could flip the update's sign; eps = 1e-3 bounds that amplification to about lr / eps = 1."""
    return OptimizerOptions(lr=1e-3, clip_grad=0.5, weight_decay=0.01, adam_eps=1e-3)


def _train(arch: str, tp: int, pp: int, zero: bool = False, sp: bool = False) -> dict:
    """Train one layout on this rank; return what the parent compares, keyed by param name.
    `zero`: reduce over DP with the ZeRO engine's NNN strategy instead of in the test;
    `sp`: sequence parallelism (pipeline boundaries then carry [b, s / tp, h])."""
    topo = Topology.from_env(tp=tp, pp=pp)
    cfg = _cfg(arch)
    check_model_split(cfg, tp, pp, sequence_parallel=sp)
    model = GPTModel(
        cfg,
        tp_group=topo.tp_group,
        sequence_parallel=sp,
        pre_process=topo.is_first_stage,
        post_process=topo.is_last_stage,
        layer_range=topo.layer_range(cfg.num_layers),
    )
    mp = [topo.model_parallel_group] if tp * pp > 1 else []
    if zero:
        engine = ZeroEngine(model, _optimizer(), PrecisionOptions(), ZeroOptions(paro_strategy="NNN"), topo)
    else:
        engine = LocalEngine(
            model, _optimizer(), PrecisionOptions(), norm_groups=mp, counts_in_norm=counts_in_norm(model, topo)
        )
    named = dict(model.named_parameters())
    result = {
        "losses": [],
        "norms": [],
        "grads": {},
        "dims": {n: tp_partition_dim(p) for n, p in named.items()},
        "tp_rank": topo.tp_rank,
    }
    for step in range(STEPS):
        mine = _global_micro_batches(step, MICRO * topo.dp)[topo.dp_rank * MICRO : (topo.dp_rank + 1) * MICRO]
        losses = forward_backward_1f1b(model, mine, engine, topology=topo, sequence_parallel=sp)
        if topo.dp > 1 and not zero:
            for p in named.values():
                comm.all_reduce(p.grad, group=topo.dp_group, tag="test/dp_grads")
                p.grad.div_(topo.dp)
        if topo.dp > 1:
            both = torch.stack(losses)
            comm.all_reduce(both, group=topo.dp_group, tag="test/dp_loss")
            losses = list((both / topo.dp).unbind())
        if step in GRAD_STEPS and not zero:
            result["grads"][step] = {n: p.grad.clone() for n, p in named.items()}
        result["losses"].append(torch.stack(losses).mean().item())
        result["norms"].append(engine.step().grad_norm)
    result["params"] = {n: p.detach().clone() for n, p in named.items()}
    held_out = _global_micro_batches(STEPS, MICRO * topo.dp)[topo.dp_rank * MICRO : (topo.dp_rank + 1) * MICRO]
    eval_losses = torch.stack(
        forward_backward_1f1b(model, held_out, engine, topology=topo, sequence_parallel=sp, forward_only=True)
    )
    if topo.dp > 1:
        comm.all_reduce(eval_losses, group=topo.dp_group, tag="test/dp_loss")
        eval_losses /= topo.dp
    result["eval_loss"] = eval_losses.mean().item()
    result["grads_after_eval"] = sum(p.grad is not None for p in named.values())
    return result


def _reference(arch: str, dp: int) -> dict:
    cfg = _cfg(arch)
    model = GPTModel(cfg)
    engine = LocalEngine(model, _optimizer(), PrecisionOptions())
    named = dict(model.named_parameters())
    result = {"losses": [], "norms": [], "grads": {}}
    for step in range(STEPS):
        losses = forward_backward(model, _global_micro_batches(step, MICRO * dp), engine)
        if step in GRAD_STEPS:
            result["grads"][step] = {n: p.grad.clone() for n, p in named.items()}
        result["losses"].append(torch.stack(losses).mean().item())
        result["norms"].append(engine.step().grad_norm)
    result["params"] = {n: p.detach().clone() for n, p in named.items()}
    held_out = _global_micro_batches(STEPS, MICRO * dp)
    result["eval_loss"] = torch.stack(forward_backward(model, held_out, engine, forward_only=True)).mean().item()
    return result


Layout = tuple[int, int, bool, bool]  # tp, pp, ZeRO NNN engine, sequence parallel


def _layouts(layouts: list[Layout]) -> dict:
    return {(arch, *layout): _train(arch, *layout) for arch in ("gpt2", "llama") for layout in layouts}


def _ref_name(name: str, cfg: ModelConfig) -> str:
    """The tied output weight of a last stage is the embedding in the single-process model."""
    return EMBEDDING_WEIGHT if name == "output_layer.weight" and cfg.tie_embeddings else name


def _compare(results: list[dict], reference: dict, cfg: ModelConfig, label: str) -> None:
    assert all(len(r["losses"]) == STEPS for r in results)
    for rank, res in enumerate(results):
        where = f"{label} rank {rank}"
        for a, b in zip(res["losses"], reference["losses"]):
            assert abs(a - b) < TOL, (where, "loss", res["losses"], reference["losses"])
        for a, b in zip(res["norms"], reference["norms"]):
            assert abs(a - b) < TOL, (where, "grad norm", res["norms"], reference["norms"])
        assert abs(res["eval_loss"] - reference["eval_loss"]) < TOL, (where, "forward-only loss")
        assert res["grads_after_eval"] == 0, (where, "forward_only left gradients")

        def check(mine: dict, ref: dict, what: str, res: dict = res, where: str = where) -> None:
            for name, value in mine.items():
                full = ref[_ref_name(name, cfg)]
                dim = res["dims"][name]
                if dim is not None:
                    full = full.chunk(full.shape[dim] // value.shape[dim], dim)[res["tp_rank"]]
                err = (value - full).abs().max().item()
                assert err < TOL, (where, what, name, err)

        for step in res["grads"]:
            check(res["grads"][step], reference["grads"][step], f"grad step {step}")
        check(res["params"], reference["params"], "final weight")


FOUR_RANK: list[Layout] = [
    (2, 1, False, False),
    (2, 1, True, False),
    (1, 2, False, False),
    (2, 2, False, False),
    (2, 2, False, True),
]
TWO_RANK: list[Layout] = [(2, 1, False, False), (1, 2, False, False)]


def _check_all(per_rank: list[dict], layouts: list[Layout]) -> None:
    world = len(per_rank)
    for arch in ("gpt2", "llama"):
        references = {}
        for tp, pp, zero, sp in layouts:
            dp = world // (tp * pp)
            if dp not in references:
                references[dp] = _reference(arch, dp)
            _compare(
                [r[(arch, tp, pp, zero, sp)] for r in per_rank],
                references[dp],
                _cfg(arch),
                f"{arch} tp{tp} pp{pp} dp{dp}{' zero NNN' if zero else ''}{' sp' if sp else ''}",
            )


def test_four_rank_layouts_match_single_process():
    """DP2 x TP2 (in-test all-reduce, and ZeRO NNN), DP2 x PP2, TP2 x PP2 (also with
    sequence parallelism) on 4 ranks."""
    _check_all(run_ranks(_layouts, 4, FOUR_RANK, timeout_s=300), FOUR_RANK)


def test_two_rank_tp_and_pp_match_single_process():
    """Pure TP=2 and pure PP=2."""
    _check_all(run_ranks(_layouts, 2, TWO_RANK, timeout_s=300), TWO_RANK)
