"""SGD as the inner optimizer (`optimizer.name: sgd`, Megatron-LM's `--optimizer sgd`).

In one process: the options refuse what would not act; LocalEngine's update is heavy-ball
momentum on the gradient plus coupled L2 on the decayed parameters only, against the formula
written out; the memory formula counts one buffer with momentum and none without; a checkpoint
of one optimizer is refused by the other, by the engine and before any rank starts. On 4 gloo
ranks (2 virtual nodes x 2): ZeroEngine under several PaRO strategies follows a LocalEngine
fed the whole global batch, holds the bytes the formula says, resumes bit for bit, and
reshards its momentum buffer to another strategy and back.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support import TINY_LLAMA, step_batch, train_losses

from megazpp.checkpoint.format import CONFIG_KEY, FORMAT_VERSION, LATEST_FILE, METADATA_FILE
from megazpp.checkpoint.load import load_checkpoint
from megazpp.checkpoint.reader import CheckpointReader
from megazpp.checkpoint.resume_check import check_resumable
from megazpp.checkpoint.save import save_checkpoint
from megazpp.checkpoint.zero_shards import full_part_state
from megazpp.config.load import load_config
from megazpp.config.schema import Config
from megazpp.errors import CheckpointError, ConfigError
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.local_engine import LocalEngine
from megazpp.optim.optimizer import is_decayed
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel.topology import Topology
from megazpp.zero import memory
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import parse_strategy
from megazpp.zero.zero_engine import ZeroEngine

STEPS, MICRO, SAVE_AT = 4, 2, 2
SGD = OptimizerOptions(name="sgd", lr=0.2, sgd_momentum=0.9, weight_decay=0.1, clip_grad=0.5)
PLAIN = dataclasses.replace(SGD, sgd_momentum=0.0)
STRATEGIES = ("NNG", "GGG", "IIG")  # ZeRO-1, ZeRO-3 and a PaRO mix
RESHARDED = ("GGG", "NNG")  # saved under the first, resumed under the second


def test_options_refuse_the_other_optimizers_settings_and_flags_reach_them():
    with pytest.raises(ConfigError, match=r"optimizer.adam_beta2 = 0.99 is set, but optimizer.name is 'sgd'"):
        OptimizerOptions(name="sgd", adam_beta2=0.99)
    with pytest.raises(ConfigError, match=r"optimizer.sgd_momentum = 0.5 is set, but optimizer.name is 'adamw'"):
        OptimizerOptions(sgd_momentum=0.5)
    with pytest.raises(ConfigError, match=r"optimizer.sgd_momentum = 1.0: expected a value in \[0, 1\)"):
        OptimizerOptions(name="sgd", sgd_momentum=1.0)
    cfg = load_config(["--optimizer", "sgd", "--sgd-momentum", "0"]).optimizer
    assert (cfg.name, cfg.sgd_momentum, cfg.state_names) == ("sgd", 0.0, ())
    assert OptimizerOptions(name="sgd").state_names == ("momentum_buffer",)
    assert OptimizerOptions().state_names == ("exp_avg", "exp_avg_sq")


def test_local_sgd_is_heavy_ball_with_coupled_l2_on_decayed_parameters_only():
    """Three steps of LocalEngine against the update written out: buf = mu * buf + (g + wd * p)
    (wd 0 for norms and biases), p -= lr * buf. The kernel (torch's foreach SGD) may fuse a
    multiply-add the formula rounds twice: within a few fp32 ulps of each element."""
    cfg = ModelConfig(**TINY_LLAMA)
    opt = dataclasses.replace(SGD, clip_grad=0.0)
    model = GPTModel(cfg)
    engine = LocalEngine(model, opt, PrecisionOptions())
    named = list(model.named_parameters())
    expect = {n: p.detach().clone() for n, p in named}
    buf: dict[str, torch.Tensor] = {}
    for step in range(3):
        model(*step_batch(cfg, 0, 0, step)).mean().backward()
        for n, p in named:
            g = p.grad + (opt.weight_decay if is_decayed(n, p) else 0.0) * expect[n]
            buf[n] = g.clone() if step == 0 else opt.sgd_momentum * buf[n] + g
            expect[n] = expect[n] - opt.lr * buf[n]
        engine.step()
        for n, p in named:
            assert torch.allclose(p.detach(), expect[n], rtol=4e-7, atol=1e-7), (step, n)
            p.data.copy_(expect[n])  # the next step from the same point: no drift of the bound
    assert any(not is_decayed(n, p) for n, p in named) and any(is_decayed(n, p) for n, p in named)
    plain = LocalEngine(GPTModel(cfg), PLAIN, PrecisionOptions())
    plain.params[0].grad = torch.ones_like(plain.params[0])
    plain.step()
    assert len(plain.optimizer.state) == 0  # momentum 0: no buffer is kept


def test_memory_formula_counts_the_optimizers_state():
    s = parse_strategy("NNG")
    for states, per_element in ((2, 12), (1, 8), (0, 4)):
        got = memory.state_bytes(s, [8, 16], d=4, k=2, param_bytes=2, accum_bytes=4, optimizer_states=states)
        assert got.optimizer == (8 + 16) // 4 * per_element, states


def test_a_checkpoint_of_one_optimizer_is_refused_by_the_other(tmp_path):
    cfg = ModelConfig(**TINY_LLAMA)
    adamw = LocalEngine(GPTModel(cfg), OptimizerOptions(), PrecisionOptions())
    sgd = LocalEngine(GPTModel(cfg), SGD, PrecisionOptions())
    with pytest.raises(CheckpointError, match="engine state holds adamw optimizer state, this run's optimizer.name"):
        sgd.load_state_dict(adamw.state_dict())
    with pytest.raises(CheckpointError, match="--optimizer sgd"):
        adamw.load_state_dict(sgd.state_dict())
    old = {k: v for k, v in adamw.state_dict().items() if k != "optimizer_name"}  # saved before SGD
    adamw.load_state_dict(old)
    # before any rank: from the saved run's config in metadata.json
    saved = Config()
    iter_dir = tmp_path / "iter_0000002"
    iter_dir.mkdir()
    meta = {"format": FORMAT_VERSION, "iteration": 2, "world_size": 1, "tp": 1, "pp": 1, "dp": 1}
    (iter_dir / METADATA_FILE).write_text(json.dumps({**meta, CONFIG_KEY: saved.to_dict()}))
    (tmp_path / LATEST_FILE).write_text(iter_dir.name)
    now = Config(optimizer=SGD)
    with pytest.raises(CheckpointError, match="iter_0000002 holds adamw optimizer state; this run's optimizer.name"):
        check_resumable(now, str(tmp_path), 1)
    check_resumable(Config(), str(tmp_path), 1)  # the same optimizer starts


def _reference(opt: OptimizerOptions, dp: int, dp_rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """LocalEngine on the global batch: this DP rank's share of each step's loss, final weights."""
    cfg = ModelConfig(**TINY_LLAMA)
    model = GPTModel(cfg)
    engine = LocalEngine(model, opt, PrecisionOptions())
    losses = []
    for step in range(STEPS):
        mine = 0.0
        for r in range(dp):
            for micro in range(MICRO):
                loss = model(*step_batch(cfg, r, micro, step)).mean() / (MICRO * dp)
                loss.backward()
                mine += loss.item() * dp if r == dp_rank else 0.0
        engine.step()
        losses.append(mine)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _build(topo: Topology, strategy: str, opt: OptimizerOptions) -> tuple[GPTModel, ZeroEngine]:
    model = GPTModel(ModelConfig(**TINY_LLAMA), tp_group=topo.tp_group)
    opts = ZeroOptions(paro_strategy=strategy, micro_batches_per_step=MICRO, reduce_bucket_size=4000)
    return model, ZeroEngine(model, opt, PrecisionOptions(), opts, topo)


def _train(model: GPTModel, engine: ZeroEngine, topo: Topology, steps: range) -> list[float]:
    return train_losses(model, engine, topo.dp_rank, steps, MICRO)


def _weights(model: GPTModel, engine: ZeroEngine) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engines_rank(ckpt_root: str) -> dict:
    topo = Topology.from_env(ranks_per_node=2)
    report: dict = {"reference": _reference(SGD, topo.dp, topo.dp_rank), "runs": {}}
    report["reference_plain"] = _reference(PLAIN, topo.dp, topo.dp_rank)
    for label, name, opt in [(n, n, SGD) for n in STRATEGIES] + [("GGG/plain", "GGG", PLAIN)]:
        model, engine = _build(topo, name, opt)
        losses = _train(model, engine, topo, range(SAVE_AT))
        ckpt = f"{ckpt_root}/{label.replace('/', '_')}"
        state = {"iteration": SAVE_AT, "model": model.state_dict(), "engine": engine.state_dict()}
        save_checkpoint(ckpt, SAVE_AT, state, topo)
        losses += _train(model, engine, topo, range(SAVE_AT, STEPS))
        masters = [m.clone() for m in engine.masters()]
        run = {"losses": losses, "weights": _weights(model, engine)}
        run["held"], run["expected"] = engine.held_bytes(), engine.expected_bytes()
        model2, engine2 = _build(topo, name, opt)
        engine2.load_state_dict(load_checkpoint(ckpt, topo)["engine"])
        run["resumed"] = _train(model2, engine2, topo, range(SAVE_AT, STEPS))
        run["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(masters, engine2.masters()))
        report["runs"][label] = run
    # the momentum buffer cut by another strategy's layout: the same training as resuming at home
    source, target = RESHARDED
    model, engine = _build(topo, target, SGD)
    part = full_part_state(CheckpointReader(f"{ckpt_root}/{source}"), 0, 0)
    report["resharded_kinds"] = sorted(k for k, v in part.tensors.items() if v)
    engine.load_state_dict(part.engine_state())
    report["resharded"] = _train(model, engine, topo, range(SAVE_AT, STEPS))
    adamw_model, adamw = _build(topo, "GGG", OptimizerOptions())
    try:
        adamw.load_state_dict(load_checkpoint(f"{ckpt_root}/GGG", topo)["engine"])
        report["refused"] = ""
    except CheckpointError as exc:
        report["refused"] = str(exc)
    return report


def test_zero_engine_sgd_follows_local_engine_and_resumes_bit_for_bit(tmp_path):
    ranks = run_ranks(_engines_rank, 4, str(tmp_path), timeout_s=600)
    for rank, report in enumerate(ranks):
        for label, run in report["runs"].items():
            losses, weights = report["reference_plain" if label.endswith("/plain") else "reference"]
            where = (rank, label)
            # fp32, only the order of the gradient reductions differs (as test_zero_engine's 1e-5)
            assert run["losses"] == pytest.approx(losses, abs=1e-5), where
            for n, w in weights.items():
                assert torch.allclose(run["weights"][n], w, rtol=1e-5, atol=1e-6), (where, n)
            assert run["held"] == run["expected"], (where, run["held"], run["expected"])
            assert run["resumed"] == run["losses"][SAVE_AT:] and run["resumed_equal"], where
        # the momentum acts: with and without it the weights part by far more than the bound
        with_momentum, without = report["reference"][1], report["reference_plain"][1]
        assert max(float((with_momentum[n] - without[n]).abs().max()) for n in without) > 1e-2
        # the same layout's optimizer bytes: master + one buffer with momentum, the master alone without
        momentum, plain = report["runs"]["GGG"]["held"].optimizer, report["runs"]["GGG/plain"]["held"].optimizer
        assert momentum == 2 * plain, (momentum, plain)
        assert report["resharded_kinds"] == ["masters", "momentum_buffer", "params"]
        assert report["resharded"] == pytest.approx(report["runs"][RESHARDED[1]]["losses"][SAVE_AT:], abs=1e-5)
        assert report["resharded"] == pytest.approx(report["runs"][RESHARDED[0]]["losses"][SAVE_AT:], abs=1e-5)
        assert "ZeRO checkpoint holds sgd optimizer state, this run's optimizer.name is 'adamw'" in report["refused"]
