"""ModelConfig refuses bad values with its message; init depends only on (seed, name);
parameter counts and FLOPs match the built model and the formula."""

from __future__ import annotations

import pytest
import torch

from megazpp.config.checks import validate_config
from megazpp.config.schema import Config
from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.flops import matmul_weights_per_token, parameter_count, training_flops_per_token
from megazpp.model.gpt import GPTModel
from megazpp.model.init import normal_init, scaled_std
from megazpp.parallel.options import ParallelOptions

BAD = [
    (dict(arch="bert"), "model.arch = 'bert'"),
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size = 30 is not divisible by model.num_attention_heads = 4"),
    (
        dict(num_attention_heads=4, num_query_groups=3),
        "num_attention_heads = 4 is not divisible by model.num_query_groups = 3",
    ),
    (dict(num_layers=0), "model.num_layers = 0: expected a positive integer"),
    (dict(vocab_size=-5), "model.vocab_size = -5"),
    (dict(hidden_size=24, num_attention_heads=8), "rotary embeddings need an even head dimension"),
    (dict(hidden_dropout=1.0), "model.hidden_dropout = 1.0"),
    (dict(attention_dropout=-0.1), "model.attention_dropout = -0.1"),
    (dict(norm_eps=0.0), "model.norm_eps = 0.0"),
    (dict(num_experts=4, moe_top_k=5), "model.moe_top_k = 5"),
    (dict(num_experts=-1), "model.num_experts = -1"),
    (dict(num_experts=4, moe_aux_loss_coeff=-1.0), "model.moe_aux_loss_coeff = -1.0"),
    (dict(arch="gpt2", num_experts=4), "only implemented for arch 'llama'"),
    (dict(init_seed="x"), "model.init_seed = 'x'"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_config_is_rejected_with_its_message(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**kwargs)
    assert message in str(info.value)


def test_bad_layer_range_and_unimplemented_combinations_are_rejected():
    cfg = ModelConfig()
    with pytest.raises(ConfigError, match=r"layer_range = \(1, 3\)"):
        GPTModel(cfg, layer_range=(1, 3))
    moe = ModelConfig(num_experts=2, moe_top_k=1)
    with pytest.raises(ConfigError, match="sequence parallelism"):
        GPTModel(moe, sequence_parallel=True)
    # the job's config check refuses it once, before any rank starts (parallel.topology.check_model_split)
    two_way = ParallelOptions(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence parallelism with model.num_experts > 0"):
        validate_config(Config(model=moe, parallel=two_way), world_size=2)
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff: 0"):
        GPTModel(moe, post_process=False, layer_range=(0, 1))
    with pytest.raises(ConfigError, match="longer than model.seq_length = 128"):
        GPTModel(cfg)(torch.zeros(1, 129, dtype=torch.long))
    # without the aux loss a MoE pipeline stage is fine
    GPTModel(ModelConfig(num_experts=2, moe_top_k=1, moe_aux_loss_coeff=0.0), post_process=False, layer_range=(0, 1))


def test_arch_defaults():
    llama, gpt2 = ModelConfig(hidden_size=512, num_attention_heads=8), ModelConfig(arch="gpt2")
    assert llama.ffn_hidden_size == 1408 and llama.tie_embeddings is False
    assert llama.num_query_groups == 8
    assert gpt2.ffn_hidden_size == 4 * gpt2.hidden_size and gpt2.tie_embeddings is True


def test_init_depends_only_on_seed_and_global_name():
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64)
    whole = dict(GPTModel(cfg).named_parameters())
    stage = GPTModel(cfg, pre_process=False, layer_range=(2, 4))
    assert set(dict(stage.named_parameters())) <= set(whole)
    for name, p in stage.named_parameters():
        assert torch.equal(p, whole[name]), name
    # the value is the named generator's draw: normal for inputs, scaled for residual writers
    w = torch.empty_like(whole["layers.3.attention.qkv.weight"])
    normal_init(cfg.init_seed, "layers.3.attention.qkv.weight", cfg.init_std)(w)
    assert torch.equal(w, whole["layers.3.attention.qkv.weight"])
    w = torch.empty_like(whole["layers.3.mlp.down_proj.weight"])
    normal_init(cfg.init_seed, "layers.3.mlp.down_proj.weight", scaled_std(cfg.init_std, 4))(w)
    assert torch.equal(w, whole["layers.3.mlp.down_proj.weight"])
    assert abs(whole["layers.3.mlp.down_proj.weight"].std().item() - 0.02 / 8**0.5) < 1e-3
    # another seed, other weights; creation order and global RNG state do not matter
    torch.manual_seed(99)
    other = dict(GPTModel(ModelConfig(**{**cfg.__dict__, "init_seed": 7})).named_parameters())
    assert not torch.equal(other["layers.0.attention.qkv.weight"], whole["layers.0.attention.qkv.weight"])
    torch.manual_seed(5)
    again = dict(GPTModel(cfg).named_parameters())
    assert all(torch.equal(again[n], whole[n]) for n in whole)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(arch="llama", num_query_groups=2),
        dict(arch="gpt2"),
        dict(arch="llama", num_experts=5, moe_top_k=2),
    ],
)
def test_parameter_count_matches_the_built_model(kwargs):
    cfg = ModelConfig(**kwargs)
    assert parameter_count(cfg) == sum(p.numel() for p in GPTModel(cfg).parameters())


def test_training_flops_formula():
    # 6-layer, 512-wide Llama (MHA, ffn 1408), vocab 32000, seq 512: worked by hand
    cfg = ModelConfig(num_layers=6, hidden_size=512, num_attention_heads=8, vocab_size=32000, seq_length=512)
    per_layer = 4 * 512 * 512 + 3 * 512 * 1408
    n = 6 * per_layer + 32000 * 512
    assert matmul_weights_per_token(cfg) == n
    assert training_flops_per_token(cfg) == 6 * n + 12 * 6 * 512 * 512
    # MoE counts only the top-k experts a token visits, plus the router
    moe = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=10,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=4,
    )
    assert matmul_weights_per_token(moe) == 4 * 16 * 16 + 2 * 3 * 16 * 4 + 8 * 16 + 10 * 16
