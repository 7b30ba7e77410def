"""Calibrate the planner: predicted vs measured step time of several strategies on this cluster.

Each rank measures what the planner takes as input: its compute rate on the model's own
forward/backward (timed until the slowest rank is done), memory bandwidth, the links by timed
all-reduces, and, for the host model of CPU ranks (gloo: the cores move the bytes, so
`Cluster.overlap` is off), a line per collective op and DP group and the AdamW rate
(`probe.probe_host`); rank 0's numbers are broadcast. Then every strategy trains a few steps
with the real ZeroEngine. Rank 0 prints predicted and measured seconds per step, the error of
each prediction, and the Spearman rank correlation (issue 10 asks for >= 0.8 and every error
within 30 %).

On netlab (2 nodes x 2 ranks, the link shaped to 1 Gbit/s), as root:

    tools/calibrate_netlab.sh 1gbit [--breakdown]

On one machine, 4 ranks carved into 2 virtual nodes over loopback (a smoke test):

    python tools/calibrate_planner.py --local --hidden-size 32 --num-layers 2 --steps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megazpp.cli import run_tool
from megazpp.config.tool_flags import add_shape_flags, model_config
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.planner.cluster import Cluster
from megazpp.planner.plan import Option, predict
from megazpp.planner.probe import (
    HOST,
    LinkProbe,
    measured_cluster,
    probe_link,
    probe_model_flops,
)
from megazpp.planner.report import measured_inputs, prediction_table, term_breakdown
from megazpp.planner.shape import StageShape, shape_of_model
from megazpp.planner.workload import Workload
from megazpp.unique_keys import JSONObject
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import parse_strategy
from megazpp.zero.zero_engine import ZeroEngine

DEFAULT_STRATEGIES = ["NNN", "NNG", "NGG", "GGG", "III", "IIG", "NIG", "GIG"]


def _model_cfg(a: argparse.Namespace) -> ModelConfig:
    return model_config(a, arch="llama", num_attention_heads=max(1, a.hidden_size // 32))


def _batches(cfg: ModelConfig, a: argparse.Namespace, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (a.micro_batches, a.micro_batch_size, cfg.seq_length + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def _measure_step(cfg: ModelConfig, a: argparse.Namespace, topo: Topology, strategy: str) -> tuple[float, StageShape]:
    model = GPTModel(cfg)
    shape = shape_of_model(model, bucket_numel=a.bucket_numel, threshold=0, layers=cfg.num_layers)
    engine = ZeroEngine(
        model,
        OptimizerOptions(lr=1e-4),
        PrecisionOptions(),
        ZeroOptions(paro_strategy=strategy, micro_batches_per_step=a.micro_batches, reduce_bucket_size=a.bucket_numel),
        topo,
    )
    batches = _batches(cfg, a, topo.dp_rank)
    times = []
    for step in range(a.warmup + a.steps):
        comm.barrier(tag="calibrate")
        start = time.perf_counter()
        for x, y in batches:
            engine.scale_loss(model(x, y).mean() / a.micro_batches).backward()
        engine.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), shape


def _rank_main(a: argparse.Namespace) -> JSONObject | None:
    topo = Topology.from_env(ranks_per_node=a.ranks_per_node)  # None: the launcher's LOCAL_WORLD_SIZE
    rpn = topo.ranks_per_node
    cfg = _model_cfg(a)
    flops = probe_model_flops(cfg, a.micro_batches, a.micro_batch_size, a.steps, topo.rank)
    intra, inter = (
        probe_link(group, len(ranks), device=HOST) if len(ranks) > 1 else LinkProbe(math.inf, 0.0)  # unused link
        for group, ranks in ((topo.dp_intra_group, topo.dp_intra_ranks), (topo.dp_inter_group, topo.dp_inter_ranks))
    )
    probed = measured_cluster(
        topo,
        flops,
        intra,
        inter,
        nodes=topo.num_nodes,
        ranks_per_node=rpn,
        inter_gbit=a.inter_gbit,
        overlap=a.overlap == "on",
    )
    times = probed.collective_times if a.collective_probe else None
    cluster = dataclasses.replace(probed.cluster, collective_times=times)
    workload = Workload(
        model=cfg,
        micro_batch=a.micro_batch_size,
        global_batch=a.micro_batch_size * a.micro_batches * topo.dp,
        param_bytes=4,
        accum_bytes=4,
        bucket_numel=a.bucket_numel,
    )
    rows = []
    for name in a.strategies:
        mine, shape = _measure_step(cfg, a, topo, name)
        measured = max(comm.all_gather_object(mine, tag="calibrate"))
        stage = predict(Option(parse_strategy(name)), [shape], workload, cluster).critical
        rows.append((name, stage.step_s, measured, {"compute": stage.compute_s, **stage.exposed}))
    if topo.rank != 0:
        return None
    return {"rows": rows, "cluster": cluster, "probed_inter": probed.probed_inter_bw}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation with tied values given their average rank."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((p - mx) * (q - my) for p, q in zip(rx, ry))
    sxx = sum((p - mx) ** 2 for p in rx)
    syy = sum((q - my) ** 2 for q in ry)
    # one square root of the product: sqrt(10) ** 2 is not 10 in floats, and 0.8 (the target)
    # must not come out as 0.7999999999999998
    return cov / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def report(result: JSONObject, a: argparse.Namespace) -> str:
    c: Cluster = result["cluster"]
    lines = [
        f"Llama {a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, vocab {a.vocab_size}, "
        f"micro-batch {a.micro_batch_size} x {a.micro_batches}, fp32, gloo; {c.nodes} nodes x {c.gpus_per_node} ranks. "
        f"{measured_inputs(c, bool(a.inter_gbit), result['probed_inter'])}",
        "",
    ]
    table, errors = prediction_table("strategy", result["rows"])
    lines += table
    rho = spearman([r[1] for r in result["rows"]], [r[2] for r in result["rows"]])
    worst = max(abs(e) for e in errors)
    ok = rho >= 0.8 and worst <= 0.3
    lines += [
        "",
        f"Spearman rank correlation {rho:.3f} (target >= 0.8); largest error {100 * worst:.1f} % "
        f"(target <= 30 %): {'PASS' if ok else 'FAIL'}",
    ]
    if a.breakdown:
        lines += term_breakdown(result["rows"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", action="store_true", help="spawn 4 gloo ranks here (2 virtual nodes x 2)")
    p.add_argument("--ranks-per-node", type=int, help="default: LOCAL_WORLD_SIZE (2 with --local)")
    p.add_argument("--inter-gbit", type=float, help="the link's rate (netlab's) instead of the probed one")
    p.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="off",
        help="'off' (default): gloo's threads move the bytes on the cores that compute, so "
        "communication is not hidden behind compute (Cluster.overlap); 'on': the GPU model",
    )
    p.add_argument("--breakdown", action="store_true", help="also print each prediction's terms")
    p.add_argument(
        "--no-collective-probe",
        dest="collective_probe",
        action="store_false",
        help="time collectives by latency and link bandwidth instead of each op's probed line",
    )
    add_shape_flags(
        p, {"num_layers": 4, "hidden_size": 256, "seq_length": 64, "vocab_size": 8192, "micro_batch_size": 1}
    )
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--bucket-numel", type=int, default=1 << 20)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES)
    a = p.parse_args(argv)
    if len(a.strategies) < 2:
        p.error("--strategies: give at least two to rank")
    if a.local:
        a.ranks_per_node = a.ranks_per_node or 2
        result = run_ranks(_rank_main, 4, a, timeout_s=3600)[0]
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        result = _rank_main(a)
        dist.destroy_process_group()
    if result is not None:
        print(report(result, a))
    return 0


if __name__ == "__main__":
    run_tool(main)
