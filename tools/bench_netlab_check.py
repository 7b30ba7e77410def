"""The planner's predicted step time of tools/bench_netlab.py's two-level rows against the
measured one (issue 28's out-of-sample check).

Reads one setting's results (`OUT/<setting>.json`: the command that made it, each row's
measured mean step time, the outer syncs included), rebuilds each two-level row's job from that
command and the row's flags (`benchmarks.suite.two_level_configs`: ZeRO-3 inside each node,
DiLoCo every 20 steps, bf16 / int4 / bf16 streamed), probes the planner's inputs on this cluster
as tools/calibrate_planner.py does, but on the groups the two-level engine runs (the island's DP
groups for the host model of CPU ranks; the peer group between islands for the inter-node link),
and prints the predicted step time (`two_level.predict_two_level` over the island's synchronous
prediction) against the measured one, with the error of each row. It trains nothing: run it on
the link the results came from (netlab at the same rate; `--local` for `loopback`), right after
the benchmark, on the same quiet machine.

Which runs built the model: the host model (probed per-op collective lines, AdamW rate, overlap
off) was chosen on issue 10's synchronous calibration runs (tools/calibrate_planner.py on
netlab at 1 and 10 Gbit/s, 2026-11-21/22, docs/planning.md); the two-level terms are the outer
traffic formulas (`megazpp.outer.traffic`) and the overlap rule of `two_level.outer_stage`,
written from the runtime's schedule, not fitted. No two-level run was used to build, fit or
choose any part of it, so on the benchmark's two-level rows the check is out of sample.

    sudo python tools/bench_netlab.py --rates 1gbit --steps 40 --warmup 20 --out runs/bench28 \\
        --only diloco-h20-bf16,diloco-h20-int4,diloco-h20-bf16-stream
    sudo TOOL=tools/bench_netlab_check.py tools/calibrate_netlab.sh 1gbit runs/bench28/1gbit.json
    python tools/bench_netlab_check.py --local runs/bench28/loopback.json   # a loopback setting
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from datetime import timedelta

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)
import torch.distributed as dist
from bench_netlab import parse_args as bench_args  # tools/, this script's directory
from bench_netlab import shared_run_args

from benchmarks.suite import MEGAZPP, two_level_configs
from megazpp.cli import run_tool
from megazpp.config.checks import check_config
from megazpp.config.load import load_config
from megazpp.errors import ConfigError
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.gpt import GPTModel
from megazpp.parallel.topology import Topology
from megazpp.planner.auto import stage_shape
from megazpp.planner.plan import Option, predict
from megazpp.planner.probe import (
    HOST,
    LinkProbe,
    measured_cluster,
    probe_link,
    probe_model_flops,
)
from megazpp.planner.report import measured_inputs, prediction_table, term_breakdown
from megazpp.planner.two_level import OuterChoice, island_job, predict_two_level
from megazpp.planner.workload import workload_of_config
from megazpp.unique_keys import JSONObject

TARGET = 0.15  # issue 28: every two-level row within 15 %


@dataclass(frozen=True)
class BenchJobs:
    """The two-level rows of one results file, as pretrain_gpt.py jobs."""

    setting: str
    world_size: int
    ranks_per_node: int
    jobs: list[tuple[str, list[str], float]]  # (row, pretrain_gpt.py arguments, measured s/step)
    skipped: list[str]


def bench_jobs(path: str) -> BenchJobs:
    """Rebuild the two-level rows of the results file `path` from the command it records
    (tools/bench_netlab.py's own flag parsing and shared arguments) and each row's flags."""
    with open(path) as f:
        recorded = json.load(f)
    words = shlex.split(recorded["command"])
    ns = bench_args(words[words.index("tools/bench_netlab.py") + 1 :])
    flags = {c.name: c.script_args() for c in two_level_configs()}
    measured, skipped = [], []
    for row in recorded["rows"]:
        name = row["config"]
        if name not in flags:
            kind = "synchronous: tools/calibrate_planner.py checks those" if row.get("runner") == MEGAZPP else "a peer"
            skipped.append(f"{name} ({kind})")
        elif row["status"] != "ok" or row.get("step_time_s") is None:
            skipped.append(f"{name} ({row['status']})")
        else:
            measured.append((name, float(row["step_time_s"])))
    if not measured:
        raise ConfigError(
            f"{path}: no two-level row measured ok (rows: {', '.join(r['config'] for r in recorded['rows'])})"
        )
    shared = shared_run_args(ns)  # the data the runs read (the tokenizer sizes the vocabulary)
    jobs = [(name, shared + flags[name], seconds) for name, seconds in measured]
    return BenchJobs(recorded["setting"], ns.nodes * ns.ranks_per_node, ns.ranks_per_node, jobs, skipped)


def _rank_main(a: argparse.Namespace) -> JSONObject | None:
    """Probe this cluster on the two-level engine's groups and predict every job of `a.bench`."""
    bench: BenchJobs = a.bench
    topo = Topology.from_env(ranks_per_node=a.ranks_per_node)  # None: the launcher's LOCAL_WORLD_SIZE
    if (topo.world_size, topo.ranks_per_node) != (bench.world_size, bench.ranks_per_node):
        raise ConfigError(
            f"{a.results}: measured on {bench.world_size} ranks, {bench.ranks_per_node} per node; "
            f"this run has {topo.world_size}, {topo.ranks_per_node} per node"
        )
    jobs = []
    for name, argv, measured in bench.jobs:
        options = check_config(load_config(argv), topo.world_size, topo.ranks_per_node)
        if options.outer is None:
            raise ConfigError(f"{a.results}: row {name} trains synchronously; expected only two-level rows here")
        jobs.append((name, options.config, options.outer, options.zero, measured))
    island_nodes = {outer.island_nodes for _, _, outer, _, _ in jobs}
    if len(island_nodes) != 1:
        raise ConfigError(
            f"{a.results}: the rows use islands of {sorted(island_nodes)} nodes; check one size at a time"
        )
    island = topo.island_view(island_nodes.pop())
    first = jobs[0][1]
    flops = probe_model_flops(
        first.model, first.num_micro_batches(topo.world_size), first.training.micro_batch_size, a.rounds, topo.rank
    )
    # the island's links: its node's DP ranks, and the peer group (my place in every island) the outer syncs use
    intra, inter = (
        probe_link(group, size, device=HOST) if size > 1 else LinkProbe(math.inf, 0.0)
        for group, size in ((island.dp_intra_group, len(island.dp_intra_ranks)), (island.peer_group, island.islands))
    )
    probed = measured_cluster(
        island,
        flops,
        intra,
        inter,
        nodes=topo.num_nodes,
        ranks_per_node=topo.ranks_per_node,
        inter_gbit=a.inter_gbit,
        overlap=a.overlap == "on",
    )
    times = probed.collective_times if a.collective_probe else None
    cluster = probed.cluster
    rows = []
    for name, cfg, outer, zero, measured in jobs:
        shape = stage_shape(GPTModel(cfg.model), cfg, island)
        zpp = dataclasses.replace(zero.zeropp, hpz=min(zero.zeropp.hpz, len(island.dp_intra_ranks)))
        workload = workload_of_config(cfg)
        job, on_island, _ = island_job(workload, cluster, outer.island_nodes, times)
        inner = predict(Option(zero.resolved, zpp), [shape], job, on_island)
        row = predict_two_level(OuterChoice.of(outer, workload.optimizer_states), inner, [shape], workload, cluster)
        c = inner.critical
        rows.append((name, row.step_s, measured, {"compute": c.compute_s, **c.exposed, "outer": row.exposed_s}))
    if topo.rank != 0:
        return None
    return {
        "rows": rows,
        "cluster": dataclasses.replace(cluster, collective_times=times),
        "probed_inter": probed.probed_inter_bw,
        "model": first.model,
    }


def report(result: JSONObject, a: argparse.Namespace) -> str:
    """Predicted vs measured per two-level row, the errors, against issue 28's 15 %."""
    bench: BenchJobs = a.bench
    m, c = result["model"], result["cluster"]
    lines = [
        f"{m.arch.capitalize()} {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, vocab "
        f"{m.vocab_size}, benchmark results {a.results} (setting {bench.setting}), gloo; {c.nodes} nodes x "
        f"{c.gpus_per_node} ranks. {measured_inputs(c, bool(a.inter_gbit), result['probed_inter'])}",
        "",
        "Two-level rows (out of sample: no two-level run built or chose the model; see the tool's docstring):",
        "",
    ]
    table, errors = prediction_table("row", result["rows"])
    lines += table
    worst = max(abs(e) for e in errors)
    lines += [
        "",
        f"largest error {100 * worst:.1f} % (target <= {100 * TARGET:.0f} %): {'PASS' if worst <= TARGET else 'FAIL'}",
    ]
    lines += [f"not checked: {', '.join(bench.skipped)}"] if bench.skipped else []
    if a.breakdown:
        lines += term_breakdown(result["rows"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="tools/bench_netlab.py's OUT/<setting>.json")
    p.add_argument(
        "--local", action="store_true", help="spawn the results' ranks here (its nodes as virtual nodes over loopback)"
    )
    p.add_argument("--ranks-per-node", type=int, help="default: LOCAL_WORLD_SIZE (the results' with --local)")
    p.add_argument("--inter-gbit", type=float, help="the link's rate instead of the probed one")
    p.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="off",
        help="'off' (default, CPU ranks): communication is not hidden behind compute; 'on': the GPU model",
    )
    p.add_argument(
        "--no-collective-probe",
        dest="collective_probe",
        action="store_false",
        help="time the island's collectives by latency and link bandwidth instead of each op's probed line",
    )
    p.add_argument("--rounds", type=int, default=5, help="compute-rate rounds (x 2, after 2 warm-up rounds)")
    p.add_argument("--breakdown", action="store_true", help="also print each prediction's terms")
    a = p.parse_args(argv)
    a.bench = bench_jobs(a.results)  # refused here, before any rank starts
    if a.local:
        a.ranks_per_node = a.ranks_per_node or a.bench.ranks_per_node
        result = run_ranks(_rank_main, a.bench.world_size, a, timeout_s=3600)[0]
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        result = _rank_main(a)
        dist.destroy_process_group()
    if result is not None:
        print(report(result, a))
    return 0


if __name__ == "__main__":
    run_tool(main)
