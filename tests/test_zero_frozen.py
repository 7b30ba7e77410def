"""Frozen parameters under every PaRO strategy: LoRA and a frozen subset on 4 gloo ranks
(2 virtual nodes x 2), one spawn for all of it.

Per strategy and model: the losses of NNN (everything replicated) within 1e-6 over 3 steps;
frozen weights bitwise unchanged after training (gathered); the engine's state saved
after step 1 and loaded into a fresh model + engine gives the next steps' losses bitwise
(the frozen subset's shards are part of the state; LoRA's state leaves its frozen buckets out,
as an adapters-only checkpoint does, and the fresh model's init is their base); model-state bytes held per rank
equal to the formulas, with the parameter term over trainable and frozen buckets and the
gradient / optimizer terms over the trainable ones only; counted bytes and calls of every step
equal to the formulas (the frozen groups' gathers included). NNN itself matches a single-process
LocalEngine fed the global batch; LoRA with activation checkpointing (GGG, ING) gives the same
losses and gathers nothing more. A second spawn checks LoRA under TP = 2 x DP = 2 and
PP = 2 x DP = 2 (1F1B) against the same reference.
"""

from __future__ import annotations

import copy

import torch
from support import TINY_LLAMA

from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.model.trainable import apply_trainable
from megazpp.optim.local_engine import LocalEngine
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel.counter import counter
from megazpp.parallel.pipeline import counts_in_norm, forward_backward_1f1b
from megazpp.parallel.topology import Topology
from megazpp.zero.frozen import FROZEN_PREFIX
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import VALID_NAMES, level_div, parse_strategy
from megazpp.zero.zero_engine import ZeroEngine

STEPS, MICRO = 3, 2
LORA = dict(TINY_LLAMA, lora_rank=4, lora_alpha=8.0)
# (model, training.trainable): adapters only; the last layer and every norm of a plain model
RUNS = {"lora": (LORA, []), "subset": (TINY_LLAMA, ["last:1", "*norm*"])}
CHECKPOINTED = ("GGG", "ING")  # LoRA with activation checkpointing: recompute inside backward
OPT = OptimizerOptions(lr=1e-2, weight_decay=0.1, clip_grad=0.5)


def _batch(cfg: ModelConfig, dp_rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * micro + dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _model(cfg: ModelConfig, patterns: list[str], topo: Topology) -> GPTModel:
    model = GPTModel(
        cfg,
        tp_group=topo.tp_group,
        pre_process=topo.is_first_stage,
        post_process=topo.is_last_stage,
        layer_range=topo.layer_range(cfg.num_layers),
    )
    apply_trainable(model, patterns, cfg)
    return model


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _reference(cfg: ModelConfig, patterns: list[str], dp: int, dp_rank: int) -> list[float]:
    """One process, the whole global batch: the loss this DP rank's data sees per step."""
    model = GPTModel(cfg)
    apply_trainable(model, patterns, cfg)
    engine = LocalEngine(model, OPT, PrecisionOptions())
    losses = []
    for _ in range(STEPS):
        mine = 0.0
        for r in range(dp):
            for micro in range(MICRO):
                loss = model(*_batch(cfg, r, micro)).mean() / (MICRO * dp)
                loss.backward()
                mine += loss.item() * dp if r == dp_rank else 0.0
        engine.step()
        losses.append(mine)
    return losses


def _train(model: GPTModel, engine: ZeroEngine, cfg: ModelConfig, topo: Topology, steps: range) -> list[dict]:
    """Per step: the loss, the engine's counted (intra, inter) bytes and calls, the formulas'."""
    out = []
    for _ in steps:
        counter.reset_step()
        total = 0.0
        for micro in range(MICRO):
            loss = model(*_batch(cfg, topo.dp_rank, micro)).mean() / MICRO
            engine.scale_loss(loss).backward()
            total += loss.item()
        engine.step()
        rows = [
            r for tag, r in counter.step_totals()["tags"].items() if tag.startswith("zero/") or tag == "train/grad_norm"
        ]
        out.append(
            {
                "loss": total,
                "counted": (sum(r["intra"] for r in rows), sum(r["inter"] for r in rows)),
                "calls": sum(r["calls"] for r in rows),
                "predicted": engine.expected_step_bytes(MICRO),
                "predicted_calls": engine.expected_step_calls(MICRO),
            }
        )
    return out


def _strategies_rank() -> dict:
    topo = Topology.from_env(ranks_per_node=2)
    report: dict = {}
    for kind, (cfg_dict, patterns) in RUNS.items():
        cfg = ModelConfig(**cfg_dict)
        report[f"{kind}/reference"] = _reference(cfg, patterns, topo.dp, topo.dp_rank)
        for name in VALID_NAMES:
            model = _model(cfg, patterns, topo)
            before = _frozen(model)
            engine = ZeroEngine(
                model,
                OPT,
                PrecisionOptions(),
                ZeroOptions(paro_strategy=name, micro_batches_per_step=MICRO, reduce_bucket_size=4000),
                topo,
            )
            steps = _train(model, engine, cfg, topo, range(1))
            # LoRA resumes adapters-only (frozen buckets left out: the fresh model's init is the
            # base), the subset from the whole state
            saved = copy.deepcopy(engine.state_dict(frozen=kind != "lora"))
            steps += _train(model, engine, cfg, topo, range(1, STEPS))
            with engine.gathered_parameters():
                after = _frozen(model)
            resumed_model = _model(cfg, patterns, topo)
            resumed = ZeroEngine(
                resumed_model,
                OPT,
                PrecisionOptions(),
                ZeroOptions(paro_strategy=name, micro_batches_per_step=MICRO, reduce_bucket_size=4000),
                topo,
            )
            resumed.load_state_dict(saved)
            report[f"{kind}/{name}"] = {
                "resumed_losses": [s["loss"] for s in _train(resumed_model, resumed, cfg, topo, range(1, STEPS))],
                "saved_buckets": [b["name"] for b in saved["buckets"]],
                "losses": [s["loss"] for s in steps],
                "steps": steps,
                "held": engine.held_bytes(),
                "expected": engine.expected_bytes(),
                "frozen_unchanged": before.keys() == after.keys()
                and all(torch.equal(before[n], after[n]) for n in before),
                "trainable_padded": [b.layout.padded for b in engine.buckets],
                "frozen_padded": [b.layout.padded for b in engine.frozen],
            }
    cfg = ModelConfig(**LORA, activation_checkpointing=True)
    for name in CHECKPOINTED:
        model = _model(cfg, [], topo)
        engine = ZeroEngine(
            model,
            OPT,
            PrecisionOptions(),
            ZeroOptions(paro_strategy=name, micro_batches_per_step=MICRO),
            topo,
        )
        report[f"lora/{name}/ckpt"] = _train(model, engine, cfg, topo, range(STEPS))
    return report


def test_every_strategy_with_lora_and_a_frozen_subset_matches_nnn():
    results = run_ranks(_strategies_rank, 4, timeout_s=600)
    for rank, report in enumerate(results):
        for kind in RUNS:
            base = report[f"{kind}/NNN"]["losses"]
            assert max(abs(a - b) for a, b in zip(base, report[f"{kind}/reference"])) < 1e-5, (kind, rank)
            assert base[-1] < base[0] - 0.02, f"{kind}: NNN did not train: {base}"
            for name in VALID_NAMES:
                run = report[f"{kind}/{name}"]
                assert max(abs(a - b) for a, b in zip(run["losses"], base)) < 1e-6, (kind, name, rank, run["losses"])
                assert run["frozen_unchanged"], (kind, name, rank)
                assert run["resumed_losses"] == run["losses"][1:], (kind, name, rank)  # bitwise
                saved_frozen = [b for b in run["saved_buckets"] if b.startswith(FROZEN_PREFIX)]
                assert len(saved_frozen) == (0 if kind == "lora" else len(run["frozen_padded"])), (kind, name)
                for s in run["steps"]:  # frozen groups' gathers included
                    assert s["counted"] == s["predicted"] and s["calls"] == s["predicted_calls"], (kind, name, rank, s)
                assert run["held"] == run["expected"], (kind, name, rank, run["held"], run["expected"])
                # the formulas spelled out: parameters over both, gradients / Adam over trainable only
                s = parse_strategy(name)
                div = {lvl: level_div(lvl, 4, 2) for lvl in (s.params, s.grads, s.optimizer_state)}
                trainable, frozen = sum(run["trainable_padded"]), sum(run["frozen_padded"])
                assert frozen > 0 and run["held"].params == (trainable + frozen) * 4 // div[s.params], (kind, name)
                assert run["held"].grads == trainable * 4 // div[s.grads], (kind, name)
                assert run["held"].optimizer == trainable * 12 // div[s.optimizer_state], (kind, name)
    for rank, report in enumerate(results):
        for name in CHECKPOINTED:
            for s, plain in zip(report[f"lora/{name}/ckpt"], report["lora/NNN"]["losses"]):
                assert abs(s["loss"] - plain) < 1e-6, (name, rank, s["loss"], plain)
                assert s["counted"] == s["predicted"] and s["calls"] == s["predicted_calls"], (name, rank, s)
    lora = results[0]
    # frozen weights are sharded by p: ZeRO-3 holds a quarter of DDP's parameter bytes
    assert lora["lora/GGG"]["held"].params * 4 == lora["lora/NNN"]["held"].params


def _model_parallel_rank() -> dict:
    report = {}
    cfg = ModelConfig(**LORA)
    for label, topo in (
        ("tp", Topology.from_env(tp=2, ranks_per_node=2)),
        ("pp", Topology.from_env(pp=2, ranks_per_node=2)),
    ):
        report[f"{label}/reference"] = _reference(cfg, [], topo.dp, topo.dp_rank)
        for name in ("NNN", "GGG", "ING"):
            model = _model(cfg, [], topo)
            engine = ZeroEngine(
                model,
                OPT,
                PrecisionOptions(),
                ZeroOptions(paro_strategy=name, micro_batches_per_step=MICRO),
                topo,
                counts_in_norm=counts_in_norm(model, topo),
            )
            losses = []
            for _ in range(STEPS):
                micro = [_batch(cfg, topo.dp_rank, m) for m in range(MICRO)]
                if label == "pp":
                    step_losses = forward_backward_1f1b(model, micro, engine, topology=topo)
                    losses.append(sum(loss.item() for loss in step_losses) / MICRO)
                else:
                    total = 0.0
                    for inputs, labels in micro:
                        loss = model(inputs, labels).mean() / MICRO
                        engine.scale_loss(loss).backward()
                        total += loss.item()
                    losses.append(total)
                engine.step()
            report[f"{label}/{name}"] = {
                "losses": losses,
                "last_stage": topo.is_last_stage,
                "held": engine.held_bytes(),
                "expected": engine.expected_bytes(),
            }
    return report


def test_lora_under_tensor_and_pipeline_parallelism_matches_one_process():
    results = run_ranks(_model_parallel_rank, 4, timeout_s=600)
    for rank, report in enumerate(results):
        for label in ("tp", "pp"):
            for name in ("NNN", "GGG", "ING"):
                run = report[f"{label}/{name}"]
                assert run["held"] == run["expected"], (label, name, rank)
                if label == "pp" and not run["last_stage"]:
                    continue  # only the last stage computes the loss
                ref = report[f"{label}/reference"]
                assert max(abs(a - b) for a, b in zip(run["losses"], ref)) < 1e-5, (
                    label,
                    name,
                    rank,
                    run["losses"],
                    ref,
                )
