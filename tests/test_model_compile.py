"""`training.compile`: layers compiled by torch.compile (TorchInductor on CPU needs a C++
compiler), and the rotary embedding's real-arithmetic form that compiled layers run.

Bounds, from fp32 rounding (u = 2**-24, the unit roundoff):
- rotary: the cos / sin tables come from fp64 angles rounded once to fp32 (|error| <= u), each
  of the two products and the sum rounds once (<= u relative each), and the complex multiply
  may contract one product into an FMA; so per element |real - complex| <= 4 u (|x0| + |x1|).
- the model: Inductor also fuses and reorders the norms' and softmax's reductions, so a
  compiled forward is not bit-identical to eager; a few ulps per op over a 2-layer fp32 model
  with values O(1) stay far below 1e-5 in the loss and 1e-5 x the largest gradient.
"""

from __future__ import annotations

import pytest
import torch

from megazpp.model.compile import compile_layers
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.model.rotary import RotaryEmbedding

U = 2.0**-24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_rotary_matches_complex_within_rounding(dtype):
    rope = RotaryEmbedding(64, 500000.0)
    x = (torch.randn(2, 300, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)).to(dtype)
    complex_form, real_form = rope.apply(x), rope.apply_real(x)
    assert real_form.dtype == dtype and real_form.shape == x.shape
    pairs = x.float().unflatten(-1, (32, 2)).abs().sum(-1)
    bound = 4 * U * pairs.repeat_interleave(2, dim=-1)
    if dtype == torch.bfloat16:  # both round the fp32 result to bf16: one bf16 ulp more
        bound = bound + complex_form.float().abs() * 2.0**-8
    assert ((real_form.float() - complex_form.float()).abs() <= bound).all()


def test_real_rotary_tables_are_cached_and_match_the_complex_ones():
    """The tables are cached per length and device; the real form's fill uses no complex op,
    so a compiled layer may fill it inside its graph."""
    rope = RotaryEmbedding(8, 10000.0)
    cos, sin = rope.real_rotations(5, torch.device("cpu"))
    assert rope.real_rotations(5, torch.device("cpu"))[0] is cos
    rotation = rope.rotations(5, torch.device("cpu"))
    assert (cos - rotation.real).abs().max() <= U and (sin - rotation.imag).abs().max() <= U


@pytest.mark.slow
def test_compiled_layers_train_like_eager():
    import torch._dynamo

    cfg = ModelConfig(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        seq_length=16,
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    eager = GPTModel(cfg)
    compiled = GPTModel(cfg)  # same init seed: the same weights
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_layers(compiled.layers) == 2
    names = [n for n, _ in eager.named_parameters()]
    assert [n for n, _ in compiled.named_parameters()] == names  # names and state dict unchanged
    for step in range(2):
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(ids, labels).mean()
            loss.backward()
            losses.append(loss.detach())
        assert abs(losses[0] - losses[1]) <= 1e-5, (step, losses)
        scale = max(p.grad.abs().max() for p in eager.parameters())
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert (a.grad - b.grad).abs().max() <= 1e-5 * scale, name
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_compile_flag_compiles_the_layers_of_the_main_job():
    import pretrain_gpt
    from megazpp.config.load import load_config
    from megazpp.parallel.topology import Topology

    flags = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --vocab-size 64 --seq-length 16".split()
    cfg = load_config(["--compile", *flags])
    assert cfg.training.compile
    model = pretrain_gpt.build_model(cfg, Topology.from_env(), torch.device("cpu"))
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in model.layers.values())
    plain = pretrain_gpt.build_model(
        load_config(flags),
        Topology.from_env(),
        torch.device("cpu"),
    )
    assert not any(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in plain.layers.values())


def _compiled(prefix: str, tokenizer: str, stage: str) -> dict[int, float]:
    from test_training_parallel import common_args

    import pretrain_gpt

    return pretrain_gpt.main(common_args(prefix, tokenizer) + ["--zero-stage", stage, "--compile"]).losses


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("stage", ["2", "3"])
def test_compiled_layers_under_zero_follow_the_eager_run(tiny_indexed_prefix, tiny_tokenizer_model, stage):
    """The ZeRO engine's hooks stay outside the compiled layers: 2 ranks under ZeRO-2 (gradient
    hooks) and ZeRO-3 (parameters gathered around each compiled layer, one fetch unit per
    layer) with --compile follow the single-process eager run within the compiled-vs-eager
    bound (ZeRO-3 measured within 5e-7 of ZeRO-3 eager)."""
    from test_training_parallel import common_args

    import pretrain_gpt
    from megazpp.launch.local_ranks import run_ranks

    args = (str(tiny_indexed_prefix), str(tiny_tokenizer_model))
    reference = pretrain_gpt.main(common_args(*args)).losses
    for losses in run_ranks(_compiled, 2, *args, stage, timeout_s=900):
        assert sorted(losses) == [1, 2, 3, 4]
        for i, loss in losses.items():
            assert loss == pytest.approx(reference[i], abs=1e-4), (i, losses, reference)


def test_a_compiled_layer_is_one_fetch_unit():
    """Its hooks must run around the compiled forward, not inside it: with threshold 0 an
    eager layer is one unit per module owning parameters, a compiled one a single unit."""
    from megazpp.zero.units import parameter_units

    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8)
    model = GPTModel(cfg)
    eager_units = [u.name for u in parameter_units(model, 0) if u.name.startswith("layers.0")]
    assert len(eager_units) > 1
    compile_layers(model.layers)  # lazy: nothing is compiled until a layer runs
    units = [u for u in parameter_units(model, 0) if u.name.startswith("layers.")]
    assert [u.name for u in units] == ["layers.0", "layers.1"]
    assert units[0].modules == [model.layers["0"]]
    assert [n for n, _ in units[0].params] == [n for n, _ in model.named_parameters() if n.startswith("layers.0.")]


@pytest.mark.parametrize("flags", [["--zero-stage", "3"], ["--paro-strategy", "IGG"], ["--paro-strategy", "auto"]])
def test_compile_with_sharded_parameters_is_accepted(flags):
    """No longer refused: each compiled layer is gathered as one unit outside its graph."""
    from megazpp.config.checks import validate_config
    from megazpp.config.load import load_config

    validate_config(load_config(["--compile", *flags]), 2)
