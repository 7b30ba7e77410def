"""LoRA adapters and `training.trainable` on one process: what trains, what is refused (one
line naming the key and the value), fresh adapters change nothing, merging equals the adapted
model. The TP / PP splits and every ZeRO strategy are in tests/test_zero_frozen.py."""

from __future__ import annotations

import pytest
import torch

from megazpp.config.checks import validate_config
from megazpp.config.load import load_config
from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.model.lora import merge_adapters
from megazpp.model.trainable import apply_trainable, trainable_fraction

TINY = dict(
    arch="llama",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    seq_length=16,
    ffn_hidden_size=40,
)


def _trained(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_what_trains():
    lora = ModelConfig(**TINY, lora_rank=4, lora_targets=["qkv", "down_proj"])
    model = GPTModel(lora)
    apply_trainable(model, [], lora)
    assert _trained(model) == {
        f"layers.{i}.{m}.lora.{f}" for i in (0, 1) for m in ("attention.qkv", "mlp.down_proj") for f in "ab"
    }
    apply_trainable(model, ["*norm*"], lora)  # patterns add to the adapters
    assert "final_norm.weight" in _trained(model) and "layers.0.attention.qkv.lora.a" in _trained(model)
    plain = ModelConfig(**TINY)
    model = GPTModel(plain)
    apply_trainable(model, ["last:1"], plain)
    assert _trained(model) == {n for n, _ in model.named_parameters() if n.startswith("layers.1.")}
    apply_trainable(model, [], plain)
    assert _trained(model) == {n for n, _ in model.named_parameters()}
    assert trainable_fraction(plain, []) == 1.0 and 0 < trainable_fraction(lora, []) < 0.2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trainable", "nope*"], "training.trainable = 'nope*': matches no parameter"),
        (
            ["--trainable", "last:3"],
            "training.trainable = 'last:3': expected last:N with N in [1, model.num_layers = 2]",
        ),
        (["--lora-rank", "4", "--lora-targets", "fc1"], "model.lora_targets = ['fc1']: unknown module 'fc1'"),
        (["--lora-rank", "-1"], "model.lora_rank = -1"),
    ],
)
def test_bad_settings_are_refused_in_one_line(flags, message):
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "64", *flags]
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(args))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_pipeline_stage_with_nothing_to_train_is_refused():
    cfg = ModelConfig(**TINY)
    first_stage = GPTModel(cfg, post_process=False, layer_range=(0, 1))
    with pytest.raises(ConfigError, match=r"selects no parameter of this pipeline stage \(layers 0..0\)"):
        apply_trainable(first_stage, ["last:1"], cfg)


def test_fresh_adapters_change_nothing_and_merging_equals_the_adapted_model():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg = ModelConfig(**TINY, lora_rank=4, lora_alpha=8.0)
    model = GPTModel(cfg).eval()
    with torch.no_grad():
        assert torch.equal(model(ids), GPTModel(ModelConfig(**TINY)).eval()(ids))
        for name, p in model.named_parameters():
            if name.endswith(".lora.b"):
                p.normal_(0.0, 0.5)
        merged = GPTModel(ModelConfig(**TINY)).eval()
        merged.load_state_dict(merge_adapters(model.state_dict(), cfg))
        torch.testing.assert_close(merged(ids), model(ids), rtol=0.0, atol=1e-5)
        assert not torch.allclose(merged(ids), GPTModel(ModelConfig(**TINY)).eval()(ids))
