"""Adapters-only checkpoints (`--save-adapters-only`) as a user runs them with pretrain_gpt.py.

One process (LocalEngine), LoRA from a Hugging Face import: the rank files hold the adapters
and nothing frozen, metadata.json records the import; a run resumed from its step-2 checkpoint
gives the uninterrupted run's losses bit for bit; a moved, edited or other base is refused in
one line at start-up; the export merges with the recorded base into transformers-equal logits.
Two ranks from the init, the last layer in bf16 under ZeRO-3 (GGG: frozen weights sharded) and LoRA
over two pipeline stages: no frozen bucket or weight is written, resume is bitwise, another
init seed is refused (and, under ZeRO, resuming with another strategy, which would reshard).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from support import HF_SIZED_LLAMA, TINY_LORA, load_script, load_tool, save_tiny_hf_llama, write_lora_run

from megazpp.checkpoint.files import file_checksum
from megazpp.checkpoint.format import METADATA_FILE
from megazpp.checkpoint.frozen_base import BASE_KEY
from megazpp.checkpoint.reader import CheckpointReader
from megazpp.errors import CheckpointError
from megazpp.interop.consolidate import consolidated_weights
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.model.lora import is_adapter
from megazpp.training.startup import prepare
from megazpp.zero.frozen import FROZEN_PREFIX, FROZEN_SAVED_KEY

ROOT = Path(__file__).resolve().parents[1]
RANK0 = "rank_tp00_pp000_dp0000.pt"


def _pretrain(argv: list[str]):
    return load_script(ROOT / "pretrain_gpt.py").main(argv)


def _config(tmp_path: Path, model: dict, data_prefix: str, tokenizer: Path, **training) -> str:
    checkpoint = {"save_interval": 2, "save_adapters_only": True}
    return str(write_lora_run(tmp_path / "run.yaml", model, data_prefix, tokenizer, checkpoint, **training))


def _rank_state(save: Path, name: str = RANK0) -> dict:
    return torch.load(save / "iter_0000002" / name, map_location="cpu", weights_only=True)


def _hf_import(tmp_path: Path, convert: ModuleType, name: str, seed: int) -> Path:
    save_tiny_hf_llama(tmp_path / f"hf_{name}", seed)
    assert convert.main(["import", "--hf-dir", str(tmp_path / f"hf_{name}"), "--save", str(tmp_path / name)]) == 0
    return tmp_path / name


def test_lora_adapters_only_from_hf_import_resumes_bitwise_refuses_other_bases_and_exports_merged(
    tmp_path, tiny_indexed_prefix, tiny_tokenizer_model
):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[interop])")
    from transformers import LlamaForCausalLM

    convert = load_tool("convert_hf")
    base = _hf_import(tmp_path, convert, "base", seed=0)
    config = _config(tmp_path, TINY_LORA, tiny_indexed_prefix, tiny_tokenizer_model)
    run = ["--config", config, "--load", str(base)]
    full = _pretrain([*run, "--save", str(tmp_path / "full")])
    _pretrain([*run, "--save", str(tmp_path / "half"), "--exit-interval", "2"])

    state = _rank_state(tmp_path / "half")
    assert state["model"] and all(is_adapter(k) for k in state["model"]), sorted(state["model"])[:4]
    assert len(state["model"]) == 2 * 5 * 2  # 2 layers x 5 linears x (a, b)
    base_meta = base / "iter_0000000" / METADATA_FILE
    meta = json.loads((tmp_path / "half" / "iter_0000002" / METADATA_FILE).read_text())
    assert meta[BASE_KEY] == {"load": str(base.resolve()), "digest": file_checksum(base_meta)}
    adapter_numel = sum(p.numel() for n, p in GPTModel(ModelConfig(**TINY_LORA)).named_parameters() if is_adapter(n))
    assert sum(v.numel() for v in state["model"].values()) == adapter_numel
    assert len(state["engine"]["optimizer"]["state"]) == 20  # Adam moments of the adapters alone
    # weights, Adam moments and RNG states of 3.5k elements: under half the import's 53k weights
    assert (tmp_path / "half" / "iter_0000002" / RANK0).stat().st_size * 2 < (
        base / "iter_0000000" / RANK0
    ).stat().st_size

    # the fine-tune flow resumes from --save (over --load's import) or from --load of the run itself
    resumed = _pretrain([*run, "--save", str(tmp_path / "half")])
    assert resumed.resumed_from == 2
    assert [resumed.losses[i] for i in (3, 4)] == [full.losses[i] for i in (3, 4)]
    assert full.losses[4] < full.losses[1]

    other = _hf_import(tmp_path, convert, "other", seed=1)
    half = ["--config", config, "--save", str(tmp_path / "half2")]
    shutil.copytree(tmp_path / "half", tmp_path / "half2")
    shutil.rmtree(tmp_path / "half2" / "iter_0000004")
    (tmp_path / "half2" / "latest").write_text("iter_0000002\n")
    expected = rf"half2/iter_0000002/metadata.json: an adapters-only checkpoint, expected its base the import {base}"
    with pytest.raises(CheckpointError, match=expected + rf" \(sha256:.*; --load {other} is another base"):
        prepare([*half, "--load", str(other)], 1)
    base_meta.write_text(base_meta.read_text().replace('"iteration": 0', '"iteration": 0, "edited": 1'))
    with pytest.raises(CheckpointError, match=expected + r".*; .*base/iter_0000000/metadata.json is sha256:"):
        prepare([*half, "--load", str(tmp_path / "half2")], 1)
    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match=expected + rf".*; {base} holds no checkpoint"):
        prepare([*half, "--load", str(tmp_path / "half2")], 1)
    shutil.copytree(tmp_path / "other", base)  # a re-import at the same path is another base
    with pytest.raises(CheckpointError, match=expected + r".*\(changed or another base\)"):
        _pretrain([*half, "--load", str(tmp_path / "half2")])
    shutil.rmtree(base)
    _hf_import(tmp_path, convert, "base", seed=0)  # the same import again: the same bytes

    assert convert.main(["export", "--load", str(tmp_path / "full"), "--hf-dir", str(tmp_path / "merged")]) == 0
    model = GPTModel(ModelConfig(**TINY_LORA)).eval()
    weights = consolidated_weights(CheckpointReader(base), CheckpointReader(base).model_config())
    adapters = torch.load(tmp_path / "full" / "iter_0000004" / RANK0, weights_only=True)["model"]
    model.load_state_dict({**weights, **adapters})
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits, model(ids), rtol=0.0, atol=1e-5
        )


RANK_RUNS = {  # (model, training.trainable, flags, what a rank file's model state may hold)
    "zero3_last_layer_bf16": (
        HF_SIZED_LLAMA,
        ["last:1"],
        ["--paro-strategy", "GGG", "--global-batch-size", "4", "--bf16"],
        lambda k: k.startswith("layers.1."),
    ),
    "pp2_lora": (TINY_LORA, [], ["--pipeline-model-parallel-size", "2"], is_adapter),
}


@pytest.mark.parametrize("kind", sorted(RANK_RUNS))
def test_two_rank_adapters_only_from_the_init_resume_bitwise(kind, tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    model, trainable, flags, kept = RANK_RUNS[kind]
    config = _config(tmp_path, model, tiny_indexed_prefix, tiny_tokenizer_model, trainable=trainable)
    run = ["--config", config, *flags]
    full = run_ranks(_pretrain, 2, [*run, "--save", str(tmp_path / "full")], timeout_s=300)
    run_ranks(_pretrain, 2, [*run, "--save", str(tmp_path / "half"), "--exit-interval", "2"], timeout_s=300)
    for file in sorted((tmp_path / "half" / "iter_0000002").glob("rank_*.pt")):
        state = _rank_state(tmp_path / "half", file.name)
        assert state["model"] and all(kept(k) for k in state["model"]), (file.name, sorted(state["model"]))
        if "buckets" in state["engine"]:  # ZeRO: no frozen bucket written
            assert state["engine"][FROZEN_SAVED_KEY] is False
            assert state["engine"]["buckets"] and not [
                b["name"] for b in state["engine"]["buckets"] if b["name"].startswith(FROZEN_PREFIX)
            ]
    meta = json.loads((tmp_path / "half" / "iter_0000002" / METADATA_FILE).read_text())
    assert meta[BASE_KEY] == {"load": None, "digest": "init_seed=1234"}

    resumed = run_ranks(_pretrain, 2, [*run, "--load", str(tmp_path / "half")], timeout_s=300)
    for r, f in zip(resumed, full):  # pipeline: NaN on the first stage (no loss there) on both
        assert r.resumed_from == 2
        assert [r.losses[i] for i in (3, 4)] == [f.losses[i] for i in (3, 4)] or all(
            r.losses[i] != r.losses[i] and f.losses[i] != f.losses[i] for i in (3, 4)
        )
    assert any(f.losses[4] == f.losses[4] for f in full)
    with pytest.raises(
        CheckpointError,
        match=r"half/iter_0000002/metadata.json: an adapters-only checkpoint, "
        r"expected its base the model init \(init_seed=1234\); the model's "
        r"init_seed is 7",
    ):
        prepare([*run, "--load", str(tmp_path / "half"), "--init-seed", "7"], 2)
    if kind == "zero3_last_layer_bf16":  # another strategy would reshard: it needs the frozen weights left out
        with pytest.raises(
            RuntimeError,
            match=r"half/iter_0000002: an adapters-only checkpoint resumes only "
            r"under the data-parallel size and PaRO strategy that saved it",
        ):
            run_ranks(_pretrain, 2, [*run, "--load", str(tmp_path / "half"), "--paro-strategy", "NNG"], timeout_s=300)
