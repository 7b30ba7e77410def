"""LocalEngine numerics: gradient accumulation, fp16 loss scaling, bf16 fp32 masters, the lr
schedule, weight-decay groups and the cross-rank gradient norm."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.local_engine import LocalEngine
from megazpp.optim.optimizer import param_groups
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.training.forward_backward import forward_backward
from megazpp.training.lr_schedule import LRSchedule


def tiny_llama() -> GPTModel:
    cfg = ModelConfig(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        seq_length=16,
        init_seed=7,
    )
    return GPTModel(cfg)


def test_gradient_accumulation_equals_one_large_batch():
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (8, 17))
    opt = OptimizerOptions(lr=1e-2, clip_grad=0.0)
    results = []
    for splits in (4, 1):
        model = tiny_llama()
        engine = LocalEngine(model, opt, PrecisionOptions())
        micro = [(t[:, :-1], t[:, 1:]) for t in tokens.chunk(splits)]
        losses = forward_backward(model, micro, engine)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        engine.step()
        results.append(
            (torch.stack(losses).mean(), grads, {n: p.detach().clone() for n, p in model.named_parameters()})
        )
    (loss4, grads4, params4), (loss1, grads1, params1) = results
    torch.testing.assert_close(loss4, loss1, rtol=1e-6, atol=0)
    assert grads4.keys() == grads1.keys()
    for name in grads1:
        torch.testing.assert_close(grads4[name], grads1[name], rtol=1e-5, atol=1e-7, msg=name)
        # Adam's first step is ~lr * sign(g): a gradient element within rounding of zero can
        # move by up to lr, so parameters are compared to a thousandth of the lr (1e-2).
        torch.testing.assert_close(params4[name], params1[name], rtol=0, atol=1e-5, msg=name)


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype)).float().square().mean()


def test_fp16_overflow_skips_step_and_halves_scale():
    torch.manual_seed(0)
    model = Affine()
    precision = PrecisionOptions(fp16=True, initial_loss_scale=1024.0, loss_scale_window=2)
    engine = LocalEngine(model, OptimizerOptions(lr=1e-2), precision)
    assert model.proj.weight.dtype == torch.float16
    x = torch.randn(3, 4)
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [m.clone() for m in engine.masters]

    out = engine.scale_loss(model(x))
    out.register_hook(lambda g: g * math.inf)  # every gradient becomes inf / NaN
    out.backward()
    result = engine.step()
    assert result.skipped and not math.isfinite(result.grad_norm)
    assert result.loss_scale == 512.0 and engine.loss_scale == 512.0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    for m, b in zip(engine.masters, masters_before):
        assert torch.equal(m, b)
    assert not engine.optimizer.state  # the optimizer never stepped

    for step in range(2):  # two good steps: applied, then the scale grows (window 2)
        engine.scale_loss(model(x)).backward()
        result = engine.step()
        assert not result.skipped and math.isfinite(result.grad_norm)
        assert result.loss_scale == (512.0 if step == 0 else 1024.0)
    assert not torch.equal(model.proj.weight, before[0])
    torch.testing.assert_close(model.proj.weight, engine.masters[0].half(), rtol=0, atol=0)


def test_fp16_hysteresis_and_min_scale():
    model = Affine()
    precision = PrecisionOptions(fp16=True, initial_loss_scale=4.0, min_loss_scale=2.0, hysteresis=2)
    engine = LocalEngine(model, OptimizerOptions(), precision)
    scales = []
    for _ in range(4):
        out = engine.scale_loss(model(torch.ones(1, 4)))
        out.register_hook(lambda g: g * math.inf)
        out.backward()
        scales.append(engine.step().loss_scale)
    assert scales == [4.0, 2.0, 2.0, 2.0]


def test_bf16_engine_keeps_fp32_masters():
    torch.manual_seed(0)
    model = Affine()
    with torch.no_grad():
        model.proj.weight.fill_(1.0)
    engine = LocalEngine(model, OptimizerOptions(lr=1e-3, weight_decay=0.0, clip_grad=0.0), PrecisionOptions(bf16=True))
    assert model.proj.weight.dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for m in engine.masters)
    x = torch.randn(8, 4)
    engine.scale_loss(model(x)).backward()
    assert model.proj.weight.grad is None  # moved into the fp32 accumulator by the hook
    engine.step()
    # One Adam step moves each weight by ~lr = 1e-3, below bf16's spacing at 1.0 (2^-7):
    # the bf16 model cannot show it, the fp32 master must keep it.
    assert torch.all(model.proj.weight == 1.0)
    assert torch.all((engine.masters[0] - 1.0).abs() > 5e-4)
    for _ in range(9):
        engine.scale_loss(model(x)).backward()
        engine.step()
    assert torch.any(model.proj.weight != 1.0)
    assert torch.equal(model.proj.weight, engine.masters[0].bfloat16())


def test_bf16_fp32_accumulation_beats_bf16_accumulation():
    """32 micro-batches: summing the bf16 micro-batch gradients in fp32 lands much closer to
    their exact (fp64) sum than summing them in bf16."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 4) for _ in range(32)]
    torch.manual_seed(1)
    single = Affine().bfloat16()
    exact = torch.zeros(4, 4, dtype=torch.float64)
    for x in xs:
        single.zero_grad()
        (single(x) / len(xs)).backward()
        exact += single.proj.weight.grad.double()
    errors = {}
    for accum in ("fp32", "bf16"):
        torch.manual_seed(1)
        model = Affine()
        engine = LocalEngine(
            model, OptimizerOptions(clip_grad=0.0), PrecisionOptions(bf16=True, grad_accum_dtype=accum)
        )
        for x in xs:
            (model(x) / len(xs)).backward()
        grads = dict(engine._master_grads())
        errors[accum] = (grads[0].double() - exact).abs().max().item()
    assert errors["fp32"] * 10 < errors["bf16"], errors


def test_lr_schedule_values():
    cosine = LRSchedule(1.0, 0.1, warmup_iters=4, decay_iters=14, style="cosine")
    assert [cosine.lr_at(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine.lr_at(4) == 1.0
    assert cosine.lr_at(9) == pytest.approx(0.55)  # halfway through decay
    assert cosine.lr_at(14) == cosine.lr_at(100) == 0.1
    linear = LRSchedule(1.0, 0.0, warmup_iters=0, decay_iters=10, style="linear")
    assert [linear.lr_at(u) for u in (0, 5, 10)] == [1.0, 0.5, 0.0]
    constant = LRSchedule(2.0, 0.0, warmup_iters=2, decay_iters=10, style="constant")
    assert [constant.lr_at(u) for u in (0, 1, 50)] == [1.0, 2.0, 2.0]
    cosine.step()
    cosine.step()
    assert cosine.lr == 0.75 and cosine.state_dict() == {"num_updates": 2}


def test_weight_decay_skips_norms_and_biases():
    model = tiny_llama()
    groups = param_groups(model.named_parameters(), 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    for name, param in model.named_parameters():
        expect = param.dim() >= 2 and not name.endswith("bias")
        assert (id(param) in decayed) == expect, name
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert any("norm" in n for n, p in model.named_parameters() if id(p) not in decayed)


def _norm_on_rank() -> tuple[float, float]:
    import torch.distributed as dist

    from megazpp.optim.grad_norm import global_grad_norm

    rank = dist.get_rank()
    grads = [torch.full((3,), float(rank + 1)), torch.tensor([2.0 * rank])]
    both = global_grad_norm(grads, groups=[dist.group.WORLD])
    local = global_grad_norm(grads)
    return float(both), float(local)


def test_grad_norm_sums_over_process_groups():
    results = run_ranks(_norm_on_rank, 2, timeout_s=120)
    # rank 0: 3 * 1^2 + 0; rank 1: 3 * 2^2 + 2^2
    expected = math.sqrt(3 + 12 + 4)
    assert [r[0] for r in results] == [pytest.approx(expected, rel=1e-6)] * 2
    assert results[0][1] == pytest.approx(math.sqrt(3)) and results[1][1] == pytest.approx(4.0)
