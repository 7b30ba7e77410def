"""Hugging Face Llama <-> megazpp with a real transformers LlamaForCausalLM (made locally,
random weights, grouped-query attention): same logits after import at TP=1 and TP=2, same
logits after export, and a checkpoint written by the trainer exports and reloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e .[interop] to run the HF tests)"
)
from support import load_script, load_tool
from test_interop_layout import checkpoint_logits_on_rank  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from megazpp.checkpoint.reader import CheckpointReader  # noqa: E402
from megazpp.interop.consolidate import consolidated_weights  # noqa: E402
from megazpp.interop.convert import export_hf, import_hf  # noqa: E402
from megazpp.interop.hf_llama import model_config_from_hf  # noqa: E402
from megazpp.interop.safetensors_io import write_hf_weights  # noqa: E402
from megazpp.launch.local_ranks import run_ranks  # noqa: E402
from megazpp.model.gpt import GPTModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=0.0, atol=1e-5)


def _tiny_hf(directory: Path, *, tie: bool = False) -> LlamaForCausalLM:
    """A 2-layer GQA Llama (4 heads, 2 kv heads) with weights large enough (std 0.2, norm
    gains included) that a wrong q/k permutation or head grouping moves logits by O(1)."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def test_import_gives_hf_logits_at_tp1_and_tp2(tmp_path):
    hf = _tiny_hf(tmp_path / "hf")
    expected = _hf_logits(hf)
    convert = load_tool("convert_hf")
    for tp in (1, 2):
        assert (
            convert.main(
                ["import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / f"tp{tp}"), "--tp", str(tp)]
            )
            == 0
        )
    reader = CheckpointReader(tmp_path / "tp1")
    model = GPTModel(reader.model_config()).eval()
    model.load_state_dict(reader.rank_state(0, 0)["model"])
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), expected, **TOL)
    shards = run_ranks(checkpoint_logits_on_rank, 2, str(tmp_path / "tp2"), _ids(), timeout_s=180)
    torch.testing.assert_close(torch.cat(shards, dim=-1), expected, **TOL)


@pytest.mark.parametrize("tie", [False, True])
def test_export_reloads_in_transformers_with_same_logits(tmp_path, tie):
    hf = _tiny_hf(tmp_path / "hf", tie=tie)
    import_hf(tmp_path / "hf", tmp_path / "mz", tp=2, pp=2)
    export_hf(tmp_path / "mz", tmp_path / "back", max_shard_bytes=200_000)  # several shards
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(_hf_logits(reloaded), _hf_logits(hf), **TOL)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert model_config_from_hf(config) == CheckpointReader(tmp_path / "mz").model_config()
    shared = reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert shared is tie and config["tie_word_embeddings"] is tie


def test_pickle_and_sharded_inputs_read_alike(tmp_path):
    hf = _tiny_hf(tmp_path / "hf")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for name in ("bin", "sharded"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    write_hf_weights(tmp_path / "sharded", state, max_shard_bytes=100_000)
    results = []
    for name in ("hf", "bin", "sharded"):
        import_hf(tmp_path / name, tmp_path / f"mz_{name}")
        reader = CheckpointReader(tmp_path / f"mz_{name}")
        results.append(consolidated_weights(reader, reader.model_config()))
    for other in results[1:]:
        assert list(other) == list(results[0])
        assert all(torch.equal(other[k], results[0][k]) for k in other)


def _train_tiny(tmp_path: Path, data_prefix: str, tokenizer: Path) -> Path:
    """Two bf16 steps of pretrain_gpt.py on the tiny corpus, checkpoint saved at step 2."""
    config = {
        "model": {
            "arch": "llama",
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 128,
            "seq_length": 32,
        },
        "data": {"data_path": [data_prefix], "split": "90,10,0", "tokenizer_model": str(tokenizer)},
        "optimizer": {"lr": 1e-2},
        "training": {
            "micro_batch_size": 2,
            "global_batch_size": 2,
            "train_iters": 2,
            "eval_interval": 1000,
            "eval_iters": 1,
        },
        "precision": {"bf16": True},
        "checkpoint": {"save": str(tmp_path / "run"), "save_interval": 2},
        "logging": {"log_interval": 1000},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    load_script(ROOT / "pretrain_gpt.py").main(["--config", str(path)])
    return path


def test_trained_checkpoint_exports_and_reloads(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    config = _train_tiny(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model)
    assert (
        load_tool("convert_hf").main(
            [
                "export",
                "--load",
                str(tmp_path / "run"),
                "--hf-dir",
                str(tmp_path / "hf"),
                "--masters",
                "--tokenizer-model",
                str(tiny_tokenizer_model),
                "--config",
                str(config),
            ]
        )
        == 0
    )
    reader = CheckpointReader(tmp_path / "run")
    assert reader.iteration == 2
    state = reader.rank_state(0, 0)
    from megazpp.config.load import load_config

    cfg = load_config(["--config", str(config)]).model
    model = GPTModel(cfg).eval()
    with torch.no_grad():
        for p, master in zip(model.parameters(), state["engine"]["masters"]):
            p.copy_(master)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reloaded.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids), **TOL)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == tiny_tokenizer_model.read_bytes()
