"""A LoRA fine-tune as a user runs it: import a Hugging Face Llama with convert_hf.py, train
adapters with pretrain_gpt.py from the import, resume, export merged, reload in transformers.

Checks: the base weights never change; a run resumed from its step-2 checkpoint gives the
uninterrupted run's losses bit for bit; both exports hold no adapter and the merged model's
logits in transformers equal the trained LoRA model's. The same from a 4-rank ING run (2
virtual nodes x 2: frozen weights sharded inside the node, saved and reassembled from the
ranks' ZeRO shards).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e .[interop] to run the HF tests)"
)
from safetensors import safe_open  # noqa: E402
from support import TINY_LORA, load_script, load_tool, save_tiny_hf_llama, write_lora_run
from transformers import LlamaForCausalLM  # noqa: E402

from megazpp.checkpoint.reader import CheckpointReader  # noqa: E402
from megazpp.interop.consolidate import consolidated_weights  # noqa: E402
from megazpp.launch.local_ranks import run_ranks  # noqa: E402
from megazpp.model.config import ModelConfig  # noqa: E402
from megazpp.model.gpt import GPTModel  # noqa: E402
from megazpp.model.lora import is_adapter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=0.0, atol=1e-5)


def _config(tmp_path: Path, name: str, data_prefix: str, tokenizer: Path) -> Path:
    return write_lora_run(tmp_path / f"{name}.yaml", TINY_LORA, data_prefix, tokenizer, {"save_interval": 2})


def _pretrain(argv: list[str]):
    return load_script(ROOT / "pretrain_gpt.py").main(argv)


def _train(tmp_path: Path, name: str, data_prefix: str, tokenizer: Path, *flags: str):
    path = _config(tmp_path, name, data_prefix, tokenizer)
    return _pretrain(["--config", str(path), "--save", str(tmp_path / name), *flags])


def _merged_logits_match(checkpoint: Path, out: Path, convert) -> dict[str, torch.Tensor]:
    """Export `checkpoint` merged to `out`; transformers' logits must equal the LoRA model's.
    Returns the checkpoint's full weights."""
    assert convert.main(["export", "--load", str(checkpoint), "--hf-dir", str(out)]) == 0
    reader = CheckpointReader(checkpoint)
    trained = consolidated_weights(reader, reader.model_config())
    model = GPTModel(ModelConfig(**TINY_LORA)).eval()
    model.load_state_dict(trained)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids), **TOL)
    return trained


def test_lora_fine_tune_from_hf_resumes_bitwise_and_exports_merged(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    save_tiny_hf_llama(tmp_path / "hf", 0)
    convert = load_tool("convert_hf")
    assert convert.main(["import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "base")]) == 0
    base = CheckpointReader(tmp_path / "base").rank_state(0, 0)["model"]

    full = _train(tmp_path, "full", tiny_indexed_prefix, tiny_tokenizer_model, "--load", str(tmp_path / "base"))
    _train(
        tmp_path,
        "half",
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        "--load",
        str(tmp_path / "base"),
        "--exit-interval",
        "2",
    )
    resumed = _train(tmp_path, "half", tiny_indexed_prefix, tiny_tokenizer_model, "--load", str(tmp_path / "half"))
    assert resumed.resumed_from == 2
    assert [resumed.losses[i] for i in (3, 4)] == [full.losses[i] for i in (3, 4)]
    assert full.losses[4] < full.losses[1]

    trained = _merged_logits_match(tmp_path / "full", tmp_path / "merged", convert)
    assert all(torch.equal(trained[k], v) for k, v in base.items()), "a frozen base weight changed"
    adapters = [k for k in trained if is_adapter(k)]
    assert len(adapters) == 2 * 5 * 2 and any(trained[k].abs().sum() > 0 for k in adapters if k.endswith(".b"))

    export = load_tool("export_checkpoint")
    assert export.main(["--load", str(tmp_path / "full"), "--out", str(tmp_path / "merged.safetensors")]) == 0
    with safe_open(str(tmp_path / "merged.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if is_adapter(k)]
        assert '"lora_rank": 0' in f.metadata()["megazpp_model_config"]


def test_lora_under_ing_saves_sharded_frozen_weights_that_export_merged(
    tmp_path, tiny_indexed_prefix, tiny_tokenizer_model
):
    save_tiny_hf_llama(tmp_path / "hf", 0)
    convert = load_tool("convert_hf")
    assert convert.main(["import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "base")]) == 0
    path = _config(tmp_path, "ing", tiny_indexed_prefix, tiny_tokenizer_model)
    argv = [
        "--config",
        str(path),
        "--save",
        str(tmp_path / "ing"),
        "--load",
        str(tmp_path / "base"),
        "--paro-strategy",
        "ING",
        "--ranks-per-node",
        "2",
        "--global-batch-size",
        "8",
    ]
    assert all(len(h.losses) == 4 for h in run_ranks(_pretrain, 4, argv, timeout_s=300))
    base = consolidated_weights(CheckpointReader(tmp_path / "base"), CheckpointReader(tmp_path / "base").model_config())
    trained = _merged_logits_match(tmp_path / "ing", tmp_path / "merged", convert)
    assert all(torch.equal(trained[k], v) for k, v in base.items()), "a frozen base weight changed"
    assert all(trained[k].abs().sum() > 0 for k in trained if k.endswith(".lora.b")), "an adapter did not train"
