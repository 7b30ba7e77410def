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

`--check RESULTS.json` (issue 28's out-of-sample check of the two-level rows): instead of
training, read one setting's results of tools/bench_netlab.py (`OUT/<setting>.json`: the
command that made it, each row's measured mean step time), rebuild each two-level row's job
from that command and the row's flags (`megazpp.bench.suite`), probe the inputs on this
cluster as above but on the groups the two-level engine runs (the island's DP groups for the
host model, the peer group between islands for the inter-node link), and print the planner's
predicted step time (`two_level.predict_two_level` over the island's synchronous prediction)
against the measured one, with the error of each row. Run it on the link the results were
measured on (netlab at the same rate; `--local` for `loopback`), right after the benchmark, on
the same quiet machine. Which runs built the model: the host model (probed per-op collective
lines, AdamW rate, overlap off) was chosen on issue 10's synchronous calibration runs (netlab
1 Gbit/s and 10 Gbit/s, 2026-11-21/22, docs/planning.md); the two-level terms are the outer
traffic formulas (`megazpp.outer.traffic`) and the overlap rule of `two_level.outer_stage`,
written from the runtime's schedule, not fitted. No two-level run was used to build, fit or
choose any part of it, so on the benchmark's two-level rows the check is out of sample.

    sudo python tools/bench_netlab.py --rates 1gbit --steps 40 --warmup 20 --out runs/bench28 \
        --only diloco-h20-bf16,diloco-h20-int4,diloco-h20-bf16-stream
    sudo tools/calibrate_netlab.sh 1gbit --check runs/bench28/1gbit.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megazpp.bench.suite import two_level_configs
from megazpp.cli import run_tool
from megazpp.config import OptimizerConfig, PrecisionConfig, load_config
from megazpp.config_checks import resolve_outer, validate_config
from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.flops import training_flops_per_token
from megazpp.model.gpt import GPTModel
from megazpp.parallel import comm
from megazpp.parallel.local_launch import run_ranks
from megazpp.parallel.topology import Topology
from megazpp.planner.auto import stage_shape
from megazpp.planner.cluster import Cluster, gbit
from megazpp.planner.plan import Option, predict
from megazpp.planner.probe import LinkProbe, broadcast_values, probe_host, probe_link, probe_memory_bandwidth
from megazpp.planner.shape import shape_of_model
from megazpp.planner.two_level import OuterChoice, island_job, predict_two_level
from megazpp.planner.workload import Workload, workload_of_config
from megazpp.tool_flags import add_shape_flags, model_config
from megazpp.zero.engine import ZeroEngine
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import parse_strategy, resolve_strategy
from megazpp.zero.zeropp import zeropp_of

DEFAULT_STRATEGIES = ["NNN", "NNG", "NGG", "GGG", "III", "IIG", "NIG", "GIG"]


def _model_cfg(a: argparse.Namespace) -> ModelConfig:
    return model_config(a, arch="llama", num_attention_heads=max(1, a.hidden_size // 32))


def _batches(cfg: ModelConfig, micro_batches: int, micro_batch_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (micro_batches, micro_batch_size, cfg.seq_length + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def _compute_rate(cfg: ModelConfig, micro_batches: int, micro_batch_size: int, steps: int, topo: Topology) -> float:
    """FLOP/s of one rank's forward + backward (no communication), timed from a barrier until
    the last rank is done: ranks sharing cores run at once, and a step's collectives wait for
    the slowest, so this is the rate a step sees (a rank timing only itself read 30-50 % high
    or low, as the scheduler favoured it or not)."""
    model = GPTModel(cfg)
    batches = _batches(cfg, micro_batches, micro_batch_size, topo.rank)
    times = []
    for i, (x, y) in enumerate(batches * (2 * steps + 2)):
        comm.barrier(tag="calibrate")
        start = time.perf_counter()
        model(x, y).mean().backward()
        comm.barrier(tag="calibrate")
        if i >= 2 * len(batches):  # two warm-up rounds: allocator growth, first-touch pages
            times.append(time.perf_counter() - start)
    return training_flops_per_token(cfg) * micro_batch_size * cfg.seq_length / statistics.fmean(times)


def _measure_step(cfg: ModelConfig, a: argparse.Namespace, topo: Topology, strategy: str) -> tuple[float, object]:
    model = GPTModel(cfg)
    shape = shape_of_model(model, bucket_numel=a.bucket_numel, threshold=0, layers=cfg.num_layers)
    engine = ZeroEngine(model, OptimizerConfig(lr=1e-4), PrecisionConfig(),
                        ZeroOptions(strategy=strategy, micro_batches_per_step=a.micro_batches,
                                    reduce_bucket_size=a.bucket_numel), topo)
    batches = _batches(cfg, a.micro_batches, a.micro_batch_size, topo.dp_rank)
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


def _rank_main(a: argparse.Namespace) -> dict | None:
    topo = Topology.from_env(ranks_per_node=a.ranks_per_node)  # None: the launcher's LOCAL_WORLD_SIZE
    rpn = topo.ranks_per_node
    cfg = _model_cfg(a)
    flops = _compute_rate(cfg, a.micro_batches, a.micro_batch_size, a.steps, topo)
    intra, inter = (probe_link(group, len(ranks)) if len(ranks) > 1 else LinkProbe(math.inf, 0.0)  # unused link
                    for group, ranks in ((topo.dp_intra_group, topo.dp_intra_ranks),
                                         (topo.dp_inter_group, topo.dp_inter_ranks)))
    fits, adam = probe_host(topo)
    comm.barrier(tag="calibrate")
    values = broadcast_values([flops, probe_memory_bandwidth(), intra.bandwidth, inter.bandwidth * rpn,
                               intra.latency, inter.latency])
    inter_bw = gbit(a.inter_gbit) if a.inter_gbit else values[3]
    cluster = Cluster(nodes=topo.num_nodes, gpus_per_node=rpn, memory_bytes=float(1 << 40), flops=values[0],
                      intra_bw=values[2], inter_bw=inter_bw, intra_latency=values[4], inter_latency=values[5],
                      memory_bw=values[1], backend="gloo", overlap=a.overlap == "on",
                      optimizer_rate=adam, collective_times=fits if a.collective_probe else None)
    workload = Workload(model=cfg, micro_batch=a.micro_batch_size, global_batch=a.micro_batch_size * a.micro_batches * topo.dp,
                        param_bytes=4, accum_bytes=4, bucket_numel=a.bucket_numel)
    rows = []
    for name in a.strategies:
        mine, shape = _measure_step(cfg, a, topo, name)
        measured = max(comm.all_gather_object(mine, tag="calibrate"))
        stage = predict(Option(parse_strategy(name)), [shape], workload, cluster).critical
        rows.append((name, stage.step_s, measured, {"compute": stage.compute_s, **stage.exposed}))
    if topo.rank != 0:
        return None
    return {"rows": rows, "cluster": cluster, "probed_inter": values[3]}


@dataclass(frozen=True)
class BenchJobs:
    """The two-level rows of one tools/bench_netlab.py results file, as pretrain_gpt.py jobs."""

    setting: str
    world_size: int
    ranks_per_node: int
    jobs: list[tuple[str, list[str], float]]  # (row, pretrain_gpt.py arguments, measured s/step)
    skipped: list[str]


def bench_jobs(path: str) -> BenchJobs:
    """Rebuild the two-level rows of the results file `path` from the command it records
    (tools/bench_netlab.py's own flag parsing and shared arguments) and each row's flags."""
    import bench_netlab  # tools/, this script's directory (first on sys.path)

    with open(path) as f:
        recorded = json.load(f)
    words = shlex.split(recorded["command"])
    ns = bench_netlab.parse_args(words[words.index("tools/bench_netlab.py") + 1:])
    flags = {c.name: c.script_args() for c in two_level_configs()}
    measured, skipped = [], []
    for row in recorded["rows"]:
        name = row["config"]
        if name not in flags:
            skipped.append(f"{name} (synchronous: checked by this tool's calibration mode)")
        elif row["status"] != "ok" or row.get("step_time_s") is None:
            skipped.append(f"{name} ({row['status']})")
        else:
            measured.append((name, float(row["step_time_s"])))
    if not measured:
        raise ConfigError(f"{path}: no two-level row measured ok (rows: {', '.join(r['config'] for r in recorded['rows'])})")
    shared = bench_netlab.shared_args(ns)  # the data the runs read (the tokenizer sizes the vocabulary)
    jobs = [(name, shared + flags[name], seconds) for name, seconds in measured]
    return BenchJobs(recorded["setting"], ns.nodes * ns.ranks_per_node, ns.ranks_per_node, jobs, skipped)


def _check_main(a: argparse.Namespace) -> dict | None:
    """Probe this cluster on the two-level engine's groups and predict every job of `a.bench`."""
    bench: BenchJobs = a.bench
    topo = Topology.from_env(ranks_per_node=a.ranks_per_node)
    if (topo.world_size, topo.ranks_per_node) != (bench.world_size, bench.ranks_per_node):
        raise ConfigError(f"--check: the results were measured on {bench.world_size} ranks, {bench.ranks_per_node} "
                          f"per node; this run has {topo.world_size}, {topo.ranks_per_node} per node")
    jobs = []
    for name, argv, measured in bench.jobs:
        cfg = load_config(argv)
        validate_config(cfg, topo.world_size)
        jobs.append((name, cfg, resolve_outer(cfg, topo.world_size, topo.ranks_per_node), measured))
    island_nodes = {outer.island_nodes for _, _, outer, _ in jobs}
    if len(island_nodes) != 1:
        raise ConfigError(f"--check: the rows use islands of {sorted(island_nodes)} nodes; check one size at a time")
    island = topo.island_view(island_nodes.pop())
    first = jobs[0][1]
    flops = _compute_rate(first.model, first.num_micro_batches(topo.world_size), first.training.micro_batch_size,
                          a.steps, topo)
    # the island's links: its node's DP ranks, and the peer group (my place in every island) the outer syncs use
    intra, inter = (probe_link(group, size) if size > 1 else LinkProbe(math.inf, 0.0)
                    for group, size in ((island.dp_intra_group, len(island.dp_intra_ranks)),
                                        (island.peer_group, island.islands)))
    fits, adam = probe_host(island)
    comm.barrier(tag="calibrate")
    rpn = topo.ranks_per_node
    values = broadcast_values([flops, probe_memory_bandwidth(), intra.bandwidth, inter.bandwidth * rpn,
                               intra.latency, inter.latency])
    cluster = Cluster(nodes=topo.num_nodes, gpus_per_node=rpn, memory_bytes=float(1 << 40), flops=values[0],
                      intra_bw=values[2], inter_bw=gbit(a.inter_gbit) if a.inter_gbit else values[3],
                      intra_latency=values[4], inter_latency=values[5], memory_bw=values[1], backend="gloo",
                      overlap=a.overlap == "on", optimizer_rate=adam)
    times = fits if a.collective_probe else None
    rows = []
    for name, cfg, outer, measured in jobs:
        workload = workload_of_config(cfg)
        shape = stage_shape(GPTModel(cfg.model), cfg, island)
        zpp = dataclasses.replace(zeropp_of(cfg.zero), hpz=min(cfg.zero.zero_hpz_partition_size,
                                                               len(island.dp_intra_ranks)))
        job, on_island, _ = island_job(workload, cluster, outer.island_nodes, times)
        inner = predict(Option(resolve_strategy(cfg.zero.paro_strategy, cfg.zero.stage), zpp), [shape], job, on_island)
        row = predict_two_level(OuterChoice.of(outer), inner, [shape], workload, cluster)
        c = inner.critical
        rows.append((name, row.step_s, measured, {"compute": c.compute_s, **c.exposed, "outer": row.exposed_s}))
    if topo.rank != 0:
        return None
    return {"rows": rows, "cluster": dataclasses.replace(cluster, collective_times=times), "probed_inter": values[3],
            "model": first.model}


def check_report(result: dict, a: argparse.Namespace) -> str:
    """Predicted vs measured per two-level row, the errors, against issue 28's 15 %."""
    bench: BenchJobs = a.bench
    lines = [_inputs(result, a, result["model"], f"benchmark results {a.check} (setting {bench.setting})"), "",
             "Two-level rows (out of sample: no two-level run built or chose the model; see the tool's docstring):",
             "", "| row | predicted s/step | measured s/step | error |", "|---|---|---|---|"]
    errors = []
    for name, predicted, measured, _ in result["rows"]:
        errors.append(predicted / measured - 1)
        lines.append(f"| {name} | {predicted:.4f} | {measured:.4f} | {100 * errors[-1]:+.1f} % |")
    worst = max(abs(e) for e in errors)
    lines += ["", f"largest error {100 * worst:.1f} % (target <= 15 %): {'PASS' if worst <= 0.15 else 'FAIL'}"]
    lines += [f"not checked: {', '.join(bench.skipped)}"] if bench.skipped else []
    if a.breakdown:
        lines += ["", "Predicted seconds per step, by term:"]
        lines += [f"  {name}: " + " ".join(f"{k}={v:.4f}" for k, v in terms.items() if v)
                  for name, _, _, terms in result["rows"]]
    return "\n".join(lines)


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
    sx = sum((p - mx) ** 2 for p in rx) ** 0.5
    sy = sum((q - my) ** 2 for q in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def _inputs(result: dict, a: argparse.Namespace, m: ModelConfig, job: str) -> str:
    """The header: the job, the cluster, and every measured input the predictions used."""
    c: Cluster = result["cluster"]
    return (f"{m.arch.capitalize()} {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, vocab {m.vocab_size}, "
            f"{job}, gloo; {c.nodes} nodes x {c.gpus_per_node} ranks. Measured inputs: "
            f"{c.flops / 1e9:.2f} GFLOP/s per rank, memory {c.memory_bw / 1e9:.1f} GB/s, intra "
            f"{c.intra_bw / 1e9:.3f} GB/s ({c.intra_latency * 1e6:.0f} us), inter {c.inter_bw * 8 / 1e9:.3f} "
            f"Gbit/s per node ({'given' if a.inter_gbit else 'probed'}; probed "
            f"{result['probed_inter'] * 8 / 1e9:.3f}), {c.inter_latency * 1e6:.0f} us; AdamW "
            f"{c.optimizer_rate / 1e6:.0f} M elements/s; overlap model {'on' if c.overlap else 'off'}; collectives "
            f"(ms per call at 4 KiB / 256 KiB / 4 MiB per member): "
            f"{', '.join(k + ' ' + '/'.join(f'{t * 1e3:.2f}' for _, t in v) for k, v in sorted((c.collective_times or {}).items())) or 'not probed'}")


def report(result: dict, a: argparse.Namespace) -> str:
    lines = [_inputs(result, a, _model_cfg(a), f"micro-batch {a.micro_batch_size} x {a.micro_batches}, fp32"), "",
             "| strategy | predicted s/step | measured s/step | error |", "|---|---|---|---|"]
    errors = []
    for name, predicted, measured, _ in result["rows"]:
        errors.append(predicted / measured - 1)
        lines.append(f"| {name} | {predicted:.4f} | {measured:.4f} | {100 * errors[-1]:+.1f} % |")
    rho = spearman([r[1] for r in result["rows"]], [r[2] for r in result["rows"]])
    worst = max(abs(e) for e in errors)
    ok = rho >= 0.8 and worst <= 0.3
    lines += ["", f"Spearman rank correlation {rho:.3f} (target >= 0.8); largest error {100 * worst:.1f} % "
              f"(target <= 30 %): {'PASS' if ok else 'FAIL'}"]
    if a.breakdown:
        lines += ["", "Predicted seconds per step, by term:"]
        lines += [f"  {name}: " + " ".join(f"{k}={v:.4f}" for k, v in terms.items() if v)
                  for name, _, _, terms in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", action="store_true", help="spawn 4 gloo ranks here (2 virtual nodes x 2; with "
                   "--check, the results' nodes x ranks per node)")
    p.add_argument("--ranks-per-node", type=int, help="default: LOCAL_WORLD_SIZE (2 with --local)")
    p.add_argument("--inter-gbit", type=float, help="the link's rate (netlab's) instead of the probed one")
    p.add_argument("--overlap", choices=("on", "off"), default="off",
                   help="'off' (default): gloo's threads move the bytes on the cores that compute, so "
                        "communication is not hidden behind compute (Cluster.overlap); 'on': the GPU model")
    p.add_argument("--breakdown", action="store_true", help="also print each prediction's terms")
    p.add_argument("--no-collective-probe", dest="collective_probe", action="store_false",
                   help="time collectives by latency and link bandwidth instead of each op's probed line")
    add_shape_flags(p, {"num_layers": 4, "hidden_size": 256, "seq_length": 64, "vocab_size": 8192,
                        "micro_batch_size": 1})
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--bucket-numel", type=int, default=1 << 20)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES)
    p.add_argument("--check", metavar="RESULTS_JSON",
                   help="predict the two-level rows of tools/bench_netlab.py's OUT/<setting>.json instead of "
                        "training (the model flags, --strategies and --micro-batches are then the results')")
    a = p.parse_args(argv)
    if len(a.strategies) < 2:
        p.error("--strategies: give at least two to rank")
    main_of, report_of = _rank_main, report
    if a.check:
        a.bench = bench_jobs(a.check)  # refused here, before any rank starts
        main_of, report_of = _check_main, check_report
    if a.local:
        a.ranks_per_node = a.ranks_per_node or (a.bench.ranks_per_node if a.check else 2)
        result = run_ranks(main_of, a.bench.world_size if a.check else 4, a, timeout_s=3600)[0]
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        result = main_of(a)
        dist.destroy_process_group()
    if result is not None:
        print(report_of(result, a))
    return 0


if __name__ == "__main__":
    run_tool(main)
