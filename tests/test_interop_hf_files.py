"""HF config and weight-file handling without transformers: every unsupported config field is
refused by name, weight files are read without executing code, and the consolidated
safetensors export holds the full weights and the model config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="safetensors (a core dependency) is not installed")
from safetensors import safe_open  # noqa: E402
from support import load_tool

from megazpp.errors import CheckpointError, ConfigError  # noqa: E402
from megazpp.interop.convert import SAFETENSORS_CONFIG_KEY, import_hf  # noqa: E402
from megazpp.interop.hf_llama import (  # noqa: E402
    hf_config_from_model,
    hf_to_megazpp,
    megazpp_to_hf,
    model_config_from_hf,
    pairs_to_rotate_half,
    rotate_half_to_pairs,
)
from megazpp.interop.safetensors_io import write_hf_weights  # noqa: E402
from megazpp.model.config import ModelConfig  # noqa: E402
from megazpp.model.gpt import GPTModel  # noqa: E402

CFG = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=64,
    seq_length=16,
    rope_theta=500.0,
    norm_eps=1e-6,
)
BASE = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500.0,
}


def _hf_dir(directory: Path, cfg: ModelConfig = CFG) -> dict[str, torch.Tensor]:
    """An HF-layout directory made by our own exporter from a seeded megazpp model."""
    full = {n: p.detach() for n, p in GPTModel(cfg).named_parameters()}
    hf = megazpp_to_hf(full, cfg)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config_from_model(cfg, torch.float32)))
    write_hf_weights(directory, hf)
    return full


def test_config_mapping_carries_theta_eps_gqa_and_tying():
    assert model_config_from_hf(BASE) == CFG
    legacy_defaults = {k: v for k, v in BASE.items() if k != "rope_theta"}
    assert model_config_from_hf(legacy_defaults).rope_theta == 10000.0
    v5 = dict(legacy_defaults, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert model_config_from_hf(v5) == CFG
    tied = model_config_from_hf(dict(BASE, tie_word_embeddings=True, num_key_value_heads=None))
    assert tied.tie_embeddings and tied.num_query_groups == 4
    assert model_config_from_hf(hf_config_from_model(CFG, torch.bfloat16)) == CFG


@pytest.mark.parametrize(
    "field,value",
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("model_type", "mistral"),
        ("head_dim", 16),
        ("sliding_window", 4096),
        ("quantization_config", {"quant_method": "gptq"}),
    ],
)
def test_unsupported_config_field_is_named(field, value):
    with pytest.raises(ConfigError, match=field):
        model_config_from_hf(dict(BASE, **{field: value}))


def test_theta_contradiction_and_missing_field_are_named():
    with pytest.raises(ConfigError, match="contradicts"):
        model_config_from_hf(dict(BASE, rope_parameters={"rope_theta": 1.0}))
    with pytest.raises(ConfigError, match="intermediate_size"):
        model_config_from_hf({k: v for k, v in BASE.items() if k != "intermediate_size"})


def test_rope_permutation_is_hf_convert_script_inverse():
    """HF's conversion maps Meta row 2i -> i and 2i+1 -> i + d/2 within each head."""
    heads, d = 3, 8
    meta_rows = torch.arange(heads * d, dtype=torch.float32).unsqueeze(1)
    hf_rows = pairs_to_rotate_half(meta_rows, heads, d)
    for h in range(heads):
        for i in range(d // 2):
            assert hf_rows[h * d + i, 0] == h * d + 2 * i
            assert hf_rows[h * d + i + d // 2, 0] == h * d + 2 * i + 1
    assert torch.equal(rotate_half_to_pairs(hf_rows, heads, d), meta_rows)


def test_missing_unexpected_and_unsafe_weights_are_refused(tmp_path):
    full = _hf_dir(tmp_path / "ok")
    hf = megazpp_to_hf(full, CFG)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        hf_to_megazpp({k: v for k, v in hf.items() if k != "model.norm.weight"}, CFG)
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        hf_to_megazpp(dict(hf, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}), CFG)
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    assert hf_to_megazpp(dict(hf, **inv_freq), CFG).keys() == full.keys()
    tied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        hf_to_megazpp(dict(hf, **{"lm_head.weight": hf["lm_head.weight"] + 1}), tied)
    bad = tmp_path / "unsafe"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    torch.save({"x": _Exploit()}, bad / "pytorch_model.bin")  # unpickling would run code
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        import_hf(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        import_hf(tmp_path, tmp_path / "never")
    (bad / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        import_hf(bad, tmp_path / "never")


class _Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_consolidated_export_holds_full_weights_and_config(tmp_path):
    full = _hf_dir(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mz", tp=2, pp=2, dtype=torch.bfloat16)
    tool = load_tool("export_checkpoint")
    out = tmp_path / "full.safetensors"
    assert tool.main(["--load", str(tmp_path / "mz"), "--out", str(out), "--dtype", "fp32"]) == 0
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == sorted(full)
        for name, tensor in full.items():
            assert torch.equal(f.get_tensor(name), tensor.to(torch.bfloat16).float()), name
        assert ModelConfig(**json.loads(f.metadata()[SAFETENSORS_CONFIG_KEY])) == CFG
