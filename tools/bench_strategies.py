"""Benchmark the 14 PaRO strategies on 4 gloo ranks carved into 2 virtual nodes x 2.

Prints a Markdown table: per strategy the model-state bytes one rank holds (parameters,
gradients, optimizer state), the intra-/inter-node bytes one rank receives per step (counted
by megazpp.parallel.comm, next to the `traffic.step_bytes` prediction), and the median step time. A
second table compares a Qwen2-MoE-like model under ZeRO-3 with module_granularity_threshold
0 and with a threshold that makes each MoE layer one parameter unit: fetch hooks and
parameter all-gathers per step, and host (CPU) time per step.

    python tools/bench_strategies.py                      # default size
    python tools/bench_strategies.py --hidden-size 64 --num-layers 2 --steps 2 --experts 8   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from megazpp.cli import run_tool
from megazpp.config.tool_flags import add_shape_flags, model_config
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel.counter import counter
from megazpp.parallel.topology import Topology
from megazpp.unique_keys import JSONObject
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import VALID_NAMES
from megazpp.zero.units import is_fine_grained
from megazpp.zero.zero_engine import ZeroEngine

WORLD, RANKS_PER_NODE = 4, 2


def _model_cfg(args: argparse.Namespace, experts: int = 0) -> ModelConfig:
    return model_config(
        args,
        arch="llama",
        num_attention_heads=max(1, args.hidden_size // 16),
        num_experts=experts,
        moe_top_k=2,
        moe_ffn_hidden_size=max(1, args.hidden_size // 4) if experts else None,
    )


def _run(cfg: ModelConfig, topo: Topology, options: ZeroOptions, args: argparse.Namespace) -> JSONObject:
    model = GPTModel(cfg)
    engine = ZeroEngine(model, OptimizerOptions(lr=1e-4), PrecisionOptions(), options, topo)
    gen = torch.Generator().manual_seed(topo.dp_rank)
    walls, cpus, stats = [], [], []
    for step in range(args.warmup + args.steps):
        counter.reset_step()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.micro_batches):
            ids = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, cfg.seq_length + 1), generator=gen)
            loss = model(ids[:, :-1], ids[:, 1:]).mean() / args.micro_batches
            engine.scale_loss(loss).backward()
        stats.append(engine.stats())
        engine.step()
        if step >= args.warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    totals = counter.step_totals()
    return {
        "held": engine.held_bytes(),
        "counted": (totals["intra"], totals["inter"]),
        "predicted": engine.expected_step_bytes(args.micro_batches),
        "hier": engine.hier,
        "wall": statistics.median(walls),
        "cpu": statistics.median(cpus),
        "stats": stats[-1],
    }


def _rank_main(args: argparse.Namespace) -> JSONObject:
    topo = Topology.from_env(ranks_per_node=RANKS_PER_NODE)
    dense = _model_cfg(args)
    out: dict[str, Any] = {"strategies": {}}  # the JSON report
    for name in args.strategies:
        opts = ZeroOptions(paro_strategy=name, micro_batches_per_step=args.micro_batches)
        out["strategies"][name] = _run(dense, topo, opts, args)
    moe = _model_cfg(args, experts=args.experts)
    layer = GPTModel(moe).layers["0"].mlp
    if not isinstance(layer, torch.nn.Module):
        raise TypeError(f"layer 0's mlp is a {type(layer).__name__}, not a module")
    threshold = 1
    while not is_fine_grained(layer, threshold):
        threshold *= 2
    out["threshold"] = threshold
    for t in (0, threshold):
        opts = ZeroOptions(
            paro_strategy="GGG", micro_batches_per_step=args.micro_batches, module_granularity_threshold=t
        )
        out[f"moe/{t}"] = _run(moe, topo, opts, args)
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _table(results: list[JSONObject], args: argparse.Namespace) -> str:
    lines = [
        f"Llama {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, micro-batch "
        f"{args.micro_batch_size} x {args.micro_batches}, fp32; 4 ranks = 2 virtual nodes x 2; "
        f"times: median of {args.steps} steps, slowest rank.",
        "",
        "| strategy | params MiB | grads MiB | optimizer MiB | total MiB | intra MiB/step | "
        "inter MiB/step | = formula | step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first = results[0]
    for name in args.strategies:
        r = first["strategies"][name]
        held = r["held"]
        exact = all(res["strategies"][name]["counted"] == res["strategies"][name]["predicted"] for res in results)
        wall = max(res["strategies"][name]["wall"] for res in results)
        lines.append(
            f"| {name} | {_mib(held.params)} | {_mib(held.grads)} | {_mib(held.optimizer)} | "
            f"{_mib(held.total)} | {_mib(r['counted'][0])} | {_mib(r['counted'][1])} | "
            f"{'yes' if exact else 'NO'} | {wall:.3f} |"
        )
    t = first["threshold"]
    lines += [
        "",
        f"MoE ({args.experts} experts per layer, 3 linears each), GGG:",
        "",
        "| module_granularity_threshold | fetch hooks/step | param all-gathers/step | host CPU s/step | step s |",
        "|---|---|---|---|---|",
    ]
    for key in (0, t):
        r = first[f"moe/{key}"]
        cpu = max(res[f"moe/{key}"]["cpu"] for res in results)
        wall = max(res[f"moe/{key}"]["wall"] for res in results)
        lines.append(
            f"| {key} | {r['stats']['fetch_hooks']} | {r['stats']['param_all_gathers']} | {cpu:.3f} | {wall:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_flags(
        parser, {"num_layers": 4, "hidden_size": 256, "seq_length": 128, "vocab_size": 4096, "micro_batch_size": 2}
    )
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategies", nargs="+", default=list(VALID_NAMES))
    args = parser.parse_args(argv)
    results = run_ranks(_rank_main, WORLD, args, timeout_s=3600)
    print(_table(results, args))
    return 0


if __name__ == "__main__":
    run_tool(main)
