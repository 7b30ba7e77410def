"""Resharding resume and consolidated export of a ZeRO-sharded checkpoint.

A 4-rank ZeRO-3 (GGG, 2 virtual nodes x 2) fp32 run trains 6 steps, saving at 3 and 6. A
2-rank NNG run resumes from step 3 (parameters, fp32 masters, Adam moments and step
redistributed) and must reproduce steps 4-6 within 1e-6: same global batch, so the sampler
gives the same samples. A 2-rank GGG run with qgZ + LoCo resumes from the same step with
the step-3 weights exactly (its LoCo buffers start from zero, with a warning).
The step-6 checkpoint exported by tools/export_checkpoint.py equals
the weights `ZeroEngine.gathered_parameters()` showed at the end of the run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import QUIET_FLAGS, TINY_MODEL_FLAGS, data_flags, load_tool

import pretrain_gpt
from megazpp.checkpoint.manager import CheckpointManager, LoadKind, LoadPlan
from megazpp.checkpoint.reader import CheckpointReader
from megazpp.checkpoint.reshard import needs_reshard
from megazpp.config.checks import check_config
from megazpp.config.load import load_config
from megazpp.data.builder import build_gpt_datasets
from megazpp.errors import CheckpointError
from megazpp.interop.consolidate import consolidated_weights
from megazpp.launch.local_ranks import run_ranks
from megazpp.parallel.topology import Topology
from megazpp.training.logger import TrainingLogger
from megazpp.training.trainer import Trainer


def _args(prefix: str, tokenizer: str, save: str, strategy: str) -> list[str]:
    return [
        *data_flags(prefix, tokenizer),
        *TINY_MODEL_FLAGS,
        "--global-batch-size",
        "8",
        "--lr",
        "1e-2",
        "--adam-eps",
        "1e-3",
        "--train-iters",
        "6",
        "--lr-warmup-iters",
        "1",
        *QUIET_FLAGS,
        "--seed",
        "5",
        "--paro-strategy",
        strategy,
        "--save",
        save,
        "--save-interval",
        "3",
    ]


def _train(argv: list[str], reshard_from: str | None) -> dict[str, Any]:
    """pretrain_gpt's setup with the checkpoint manager resharding: losses, the gathered weights right after
    the resume and at the end, whether the manager saw a layout change, the engine's warnings."""
    options = check_config(load_config(argv), int(os.environ["WORLD_SIZE"]))
    cfg = options.config
    topology = Topology.from_env(cfg.tp, cfg.pp, cfg.parallel.ranks_per_node)
    pretrain_gpt.seed_everything(cfg.training.seed, topology)
    t = cfg.training
    train_ds, _, _ = build_gpt_datasets(
        options.data, cfg.model.seq_length, (t.train_iters * t.global_batch_size, 0, 0), t.seed
    )
    device = torch.device("cpu")
    model = pretrain_gpt.build_model(cfg, topology, device)
    engine = pretrain_gpt.build_engine(model, topology, options)
    logger = TrainingLogger(
        enabled=False,
        tensorboard_dir=None,
        log_interval=100,
        train_iters=t.train_iters,
        tokens_per_step=1,
        flops_per_step=1.0,
        world_size=topology.world_size,
        device=device,
    )
    plan = LoadPlan(LoadKind.RESUME, reshard_from, "resharding", None) if reshard_from is not None else None
    checkpoints = CheckpointManager(cfg, topology, device, plan)
    trainer = Trainer(options, model, engine, topology, train_ds, None, logger, device, checkpoints=checkpoints)
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = warnings.append  # type: ignore[method-assign]
    logging.getLogger("megazpp.zero").addHandler(handler)
    out: dict[str, Any] = {"changed": False}
    if reshard_from is not None:
        out["changed"] = needs_reshard(reshard_from, engine, topology)
        loaded = checkpoints.load(model, engine)
        assert loaded is not None
        trainer.resume(loaded)
        with engine.gathered_parameters():
            out["resumed"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["losses"] = trainer.train().losses
    with engine.gathered_parameters():
        out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    logging.getLogger("megazpp.zero").removeHandler(handler)
    out["warnings"] = [r.getMessage() for r in warnings if r.levelno >= logging.WARNING]
    return out


def _resume_legs(nng: list[str], ggg_loco: list[str], step3: str) -> list[dict[str, Any]]:
    return [_train(nng, step3), _train(ggg_loco, step3)]


def test_reshard_ggg4_to_nng2_and_export(tiny_indexed_prefix, tiny_tokenizer_model, tmp_path):
    data = (str(tiny_indexed_prefix), str(tiny_tokenizer_model))
    env = {"LOCAL_WORLD_SIZE": "2"}
    sharded = str(tmp_path / "ggg4")
    run = run_ranks(_train, 4, _args(*data, sharded, "GGG"), None, timeout_s=300, env=env)[0]
    reference, gathered = run["losses"], run["final"]
    assert reference[6] < reference[1] - 0.05  # the steps change the model
    step3 = str(Path(sharded) / "iter_0000003")

    loco = _args(*data, str(tmp_path / "ggg2_loco"), "GGG") + ["--zero-quantized-gradients", "--loco"]
    legs = run_ranks(_resume_legs, 2, _args(*data, str(tmp_path / "nng2"), "NNG"), loco, step3, timeout_s=300, env=env)
    cfg = load_config(_args(*data, sharded, "GGG")).model
    at_step3 = consolidated_weights(CheckpointReader(step3), cfg)
    for nng, ggg in legs:
        assert nng["changed"] and ggg["changed"]
        assert sorted(nng["losses"]) == [4, 5, 6]
        for i in (4, 5, 6):
            assert nng["losses"][i] == pytest.approx(reference[i], abs=1e-6), (i, nng["losses"], reference)
        for leg in (nng, ggg):  # replicated (NNG) and released-then-gathered (GGG) parameters
            assert sorted(leg["resumed"]) == sorted(at_step3)
            assert all(torch.equal(leg["resumed"][n], t) for n, t in at_step3.items())
        # step 4's forward uses the exact step-3 weights; later steps see qgZ's 4-bit gradients
        assert ggg["losses"][4] == pytest.approx(reference[4], abs=1e-6)
        assert ggg["losses"][6] == pytest.approx(reference[6], abs=2e-2)
        assert any("LoCo error buffers" in w for w in ggg["warnings"]), ggg["warnings"]
        assert not nng["warnings"]

    export_checkpoint = load_tool("export_checkpoint")
    out = tmp_path / "full.safetensors"
    assert export_checkpoint.main(["--load", sharded, "--out", str(out)]) == 0
    exported = load_file(str(out))
    assert sorted(exported) == sorted(gathered)
    for name, tensor in gathered.items():
        assert torch.equal(exported[name], tensor), name
    masters = tmp_path / "masters.safetensors"
    assert export_checkpoint.main(["--load", sharded, "--out", str(masters), "--masters"]) == 0
    for name, tensor in load_file(str(masters)).items():  # fp32 run: masters are the weights
        assert torch.equal(tensor, gathered[name]), name


def test_reshard_refuses_other_tensor_parallel_layout(tiny_indexed_prefix, tmp_path):
    from megazpp.interop.checkpoint_io import write_weights_checkpoint
    from megazpp.model.config import ModelConfig
    from megazpp.model.gpt import GPTModel

    cfg = ModelConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=128,
        seq_length=16,
    )
    path = write_weights_checkpoint(tmp_path / "tp2", cfg, GPTModel(cfg).state_dict(), tp=2, pp=1)
    topology = Topology.from_env(1, 1)
    with pytest.raises(CheckpointError, match="tp 2"):
        needs_reshard(path, None, topology)


def test_a_frozen_base_checkpoint_of_the_same_layout_is_not_resharded(
    tiny_indexed_prefix, tiny_tokenizer_model, tmp_path
):
    """A LoRA run's ZeRO checkpoint holds the frozen buckets after the trainable ones: the same
    layout resumes it as its own (reshard's layout comparison reads the same buckets the state
    holds), not through resharding, which a two-level checkpoint refuses."""
    save = str(tmp_path / "lora")
    argv = _args(str(tiny_indexed_prefix), str(tiny_tokenizer_model), save, "NNG") + ["--lora-rank", "4"]
    pretrain_gpt.main([*argv, "--train-iters", "1"])
    cfg = load_config(argv)
    topology = Topology.from_env()
    model = pretrain_gpt.build_model(cfg, topology, torch.device("cpu"))
    engine = pretrain_gpt.build_engine(model, topology, check_config(cfg))
    assert engine.frozen and engine.buckets  # both kinds saved
    assert not needs_reshard(save, engine, topology)
