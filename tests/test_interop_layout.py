"""The TP/PP layout the converters cut checkpoints by, checked against the real TP layers, and
the checkpoint reader/writer's round trips and refusals (no transformers needed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from megazpp.checkpoint.reader import CheckpointReader
from megazpp.checkpoint.save import save_checkpoint
from megazpp.errors import CheckpointError, ConfigError, TopologyError
from megazpp.interop.checkpoint_io import write_weights_checkpoint
from megazpp.interop.consolidate import consolidated_weights
from megazpp.interop.model_layout import full_weight_names, shard_for_rank, stage_layouts
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.parallel.tensor_parallel import tp_partition_dim
from megazpp.parallel.topology import Topology

pytest.importorskip("safetensors", reason="safetensors (a core dependency) is not installed")

LLAMA_GQA = dict(
    arch="llama",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=64,
    seq_length=16,
)
GPT2_TIED = dict(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
LLAMA_MOE = dict(LLAMA_GQA, num_experts=4, moe_top_k=2)


def _full_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in GPTModel(cfg).named_parameters()}


def checkpoint_logits_on_rank(ckpt_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """This rank's vocab shard of the logits of a TP model loaded from a checkpoint saved at
    TP = world size (also used by the transformers tests: this module does not import it,
    so spawned ranks start quickly)."""
    topo = Topology.from_env(tp=dist.get_world_size())
    reader = CheckpointReader(ckpt_dir)
    model = GPTModel(reader.model_config(), tp_group=topo.tp_group).eval()
    model.load_state_dict(reader.rank_state(topo.tp_rank, 0)["model"])
    with torch.no_grad():
        return model(ids)


def _layout_on_rank(configs: list[dict], ckpt_dir: str, ids: torch.Tensor) -> dict:
    """Per config: does the real TP=2 model (same seed) equal the cut of the single-process
    weights, with the registry's split dims? Then: the logits of a tp=2 checkpoint."""
    topo = Topology.from_env(tp=2)
    mismatches = []
    for kwargs in configs:
        cfg = ModelConfig(**kwargs)
        stage = stage_layouts(cfg, 2, 1)[0]
        expected = shard_for_rank(_full_weights(cfg), stage, cfg, 2, topo.tp_rank)
        model = GPTModel(cfg, tp_group=topo.tp_group)
        got = model.state_dict()
        if list(got) != list(expected):
            mismatches.append((cfg.arch, "keys", sorted(set(got) ^ set(expected))))
        for name, tensor in got.items():
            if not torch.equal(tensor, expected[name]):
                mismatches.append((cfg.arch, name, "values"))
        for name, p in model.named_parameters():
            if tp_partition_dim(p) != stage.split_dims[name]:
                mismatches.append((cfg.arch, name, tp_partition_dim(p), stage.split_dims[name]))
    return {"mismatches": mismatches, "logits": checkpoint_logits_on_rank(ckpt_dir, ids)}


def test_layout_matches_tensor_parallel_layers_and_tp2_checkpoint_runs(tmp_path):
    cfg = ModelConfig(**LLAMA_GQA, init_seed=7)
    full = _full_weights(cfg)
    write_weights_checkpoint(tmp_path / "ckpt", cfg, full, tp=2, pp=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = GPTModel(cfg).eval()(ids)
    results = run_ranks(
        _layout_on_rank, 2, [LLAMA_GQA, GPT2_TIED, LLAMA_MOE], str(tmp_path / "ckpt"), ids, timeout_s=180
    )
    for r in results:
        assert r["mismatches"] == []
    logits = torch.cat([r["logits"] for r in results], dim=-1)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,tp,pp",
    [(LLAMA_GQA, 2, 2), (GPT2_TIED, 2, 2), (dict(LLAMA_GQA, tie_embeddings=True), 1, 2), (LLAMA_MOE, 2, 1)],
)
def test_write_then_consolidate_is_identity(tmp_path, kwargs, tp, pp):
    cfg = ModelConfig(**kwargs)
    full = _full_weights(cfg)
    path = write_weights_checkpoint(tmp_path, cfg, full, tp=tp, pp=pp)
    assert len(list(path.glob("rank_*.pt"))) == tp * pp
    back = consolidated_weights(CheckpointReader(tmp_path), cfg)
    assert list(back) == full_weight_names(cfg) == list(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name
    if cfg.tie_embeddings and pp > 1:  # the last stage got its own copy of the embedding
        last = CheckpointReader(path).rank_state(0, pp - 1)["model"]
        embedding = full["embedding.word_embeddings.weight"]
        assert torch.equal(last["output_layer.weight"], embedding.chunk(tp)[0])


def test_trainer_saved_checkpoint_needs_config_and_reads_masters(tmp_path):
    """A checkpoint saved by training's save_checkpoint (LocalEngine-shaped state) has no
    model config in its metadata; masters come from the engine state in parameter order."""
    cfg = ModelConfig(**LLAMA_GQA)
    model = GPTModel(cfg)
    masters = [p.detach().double().float() + 1.0 for p in model.parameters()]
    state = {
        "iteration": 5,
        "consumed_samples": 10,
        "model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
        "engine": {"optimizer": {}, "masters": masters, "loss_scaler": None},
    }
    save_checkpoint(tmp_path, 5, state, Topology.from_env())
    reader = CheckpointReader(tmp_path)
    with pytest.raises(ConfigError, match="--config"):
        reader.model_config()
    got = consolidated_weights(reader, reader.model_config(cfg), masters=True)
    names = [n for n, _ in model.named_parameters()]
    for name, master in zip(names, masters):
        assert torch.equal(got[name], master)
    plain = consolidated_weights(reader, cfg)
    assert all(t.dtype == torch.bfloat16 for t in plain.values())
    with pytest.raises(CheckpointError, match="shape"):
        consolidated_weights(reader, dataclasses.replace(cfg, ffn_hidden_size=128))
    state["engine"] = {"strategy": "GGG", "buckets": []}  # saved with parameters gathered
    state["iteration"] = 6
    save_checkpoint(tmp_path, 6, state, Topology.from_env())
    whole = consolidated_weights(CheckpointReader(tmp_path), cfg)
    assert all(torch.equal(whole[k], plain[k]) for k in plain)
    with pytest.raises(CheckpointError, match="strategy GGG.*without shard placement"):
        consolidated_weights(CheckpointReader(tmp_path), cfg, masters=True)
    state["model"] = {k: v[:0].flatten() for k, v in state["model"].items()}  # released
    state["iteration"] = 7
    save_checkpoint(tmp_path, 7, state, Topology.from_env())
    with pytest.raises(CheckpointError, match="strategy GGG.*without shard placement"):
        consolidated_weights(CheckpointReader(tmp_path), cfg)


def test_refusals(tmp_path):
    cfg = ModelConfig(**LLAMA_GQA)
    full = _full_weights(cfg)
    with pytest.raises(TopologyError, match="num_query_groups"):
        write_weights_checkpoint(tmp_path / "a", cfg, full, tp=4, pp=1)
    write_weights_checkpoint(tmp_path / "b", cfg, full, tp=1, pp=2)
    with pytest.raises(CheckpointError, match="already holds"):
        write_weights_checkpoint(tmp_path / "b", cfg, full, tp=1, pp=1)
    reader = CheckpointReader(tmp_path / "b")
    with pytest.raises(ConfigError, match="ffn_hidden_size"):
        reader.model_config(dataclasses.replace(cfg, ffn_hidden_size=32))
    (reader.rank_file(0, 1)).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        consolidated_weights(reader, cfg)
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointReader(tmp_path / "nothing")
    meta = tmp_path / "b" / "iter_0000000" / "metadata.json"
    meta.write_text(json.dumps({"format": 1, "iteration": 0, "tp": 0, "pp": 1, "dp": 1}))
    with pytest.raises(CheckpointError, match="tp = 0"):
        CheckpointReader(tmp_path / "b")
