"""`zero.paro_strategy: auto` with islands, through pretrain_gpt.py on 4 gloo ranks (2 islands
of one node x 2 ranks): the islands run the strategy the planner recommends for the two-level
job (`two_level.plan_island`, computed here from the same inputs: the `planner` section's
given rates, no probe), the log says what it chose and why, and a few steps train."""

from __future__ import annotations

import logging
import re

import pretrain_gpt
from megazpp.config.checks import resolve_outer
from megazpp.config.load import load_config
from megazpp.config.schema import Config
from megazpp.launch.local_ranks import run_ranks
from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.plan import plan
from megazpp.planner.shape import shapes_of_config
from megazpp.planner.two_level import OuterChoice, island_job, plan_island
from megazpp.planner.workload import workload_of_config
from megazpp.zero.zeropp import ZeroPP
from tests.test_training_parallel import common_args

# given rates (no probe: the test's planner inputs equal the ranks'); at 100 Mbit/s between
# islands the outer syncs of a whole os (p = N, os = N) cost more than its fewer inner calls save
PLANNER = {
    "accelerator_memory_gib": 0.0025,
    "achievable_tflops": 0.01,
    "intra_node_gbs": 1.0,
    "inter_node_gbit": 0.1,
    "probe": False,
}
FLAGS = [
    "--outer-algorithm",
    "diloco",
    "--outer-sync-every",
    "2",
    "--outer-quantize",
    "bf16",
    "--paro-strategy",
    "auto",
    "--ranks-per-node",
    "2",
]


def _yaml(tmp_path) -> str:
    path = tmp_path / "planner.yaml"
    path.write_text(
        "planner:\n" + "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in PLANNER.items())
    )
    return str(path)


def _job(args: list[str]) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("megazpp.planner.auto")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        history = pretrain_gpt.main(args)
    finally:
        logger.removeHandler(handler)
    return {"losses": history.losses, "log": records}


def _cluster(cfg: Config) -> Cluster:
    """The 2 nodes x 2 ranks at the `planner` section's rates, as the ranks see them."""
    p = cfg.planner
    return Cluster(
        nodes=2,
        gpus_per_node=2,
        memory_bytes=p.accelerator_memory_gib * GIB,
        flops=p.achievable_tflops * 1e12,
        intra_bw=p.intra_node_gbs * 1e9,
        inter_bw=p.inter_node_gbit * 1e9 / 8,
        intra_latency=p.intra_node_latency_us * 1e-6,
        inter_latency=p.inter_node_latency_us * 1e-6,
        memory_bw=p.memory_bandwidth_gbs * 1e9,
        usable_memory_fraction=p.usable_memory_fraction,
        backend="gloo",
        overlap=False,
    )


def _expected(args: list[str]) -> str:
    """The planner's own recommendation for the island, from the inputs the ranks use."""
    cfg = load_config(args)
    outer = resolve_outer(cfg, 4, 2)
    workload = workload_of_config(cfg)
    shapes = shapes_of_config(cfg.model, bucket_numel=workload.bucket_numel)
    whole = _cluster(cfg)
    island = plan_island(
        shapes, workload, whole, OuterChoice.of(outer, workload.optimizer_states), fixed_zeropp=ZeroPP()
    )
    assert island.choice is not None and island.runner_up is not None
    # the outer traffic decides: the island's synchronous plan alone would pick another strategy
    job, alone, _ = island_job(workload, whole, outer.island_nodes)
    assert plan(shapes, job, alone, fixed_zeropp=ZeroPP()).choice.name != island.choice.inner.name
    return island.choice.inner.option.strategy.name


def test_auto_with_islands_runs_the_planners_choice(tiny_indexed_prefix, tiny_tokenizer_model, tmp_path):
    args = common_args(str(tiny_indexed_prefix), str(tiny_tokenizer_model)) + ["--config", _yaml(tmp_path)] + FLAGS
    ranks = run_ranks(_job, 4, args, timeout_s=300)
    expected = _expected(args)
    chosen = [re.search(r"auto with islands -> (\w+) in each of 2 islands", line) for line in ranks[0]["log"]]
    chosen = [m.group(1) for m in chosen if m]
    assert chosen == [expected], ranks[0]["log"]
    assert "priced as the two-level job" in ranks[0]["log"][0] and "**<-**" in ranks[0]["log"][0]
    assert sorted(ranks[0]["losses"]) == [1, 2, 3, 4]
    assert all(loss == loss for loss in ranks[0]["losses"].values())  # trained, no NaN


def test_auto_with_a_synchronous_start_plans_each_phase(tiny_indexed_prefix, tiny_tokenizer_model, tmp_path):
    """With `outer.start_iter` the first steps run the strategy the planner recommends for the
    synchronous job over all 4 DP ranks, and from the switch the islands run the one it recommends
    for the two-level job (the same as from the start): auto plans each phase as what it is."""
    args = common_args(str(tiny_indexed_prefix), str(tiny_tokenizer_model)) + ["--config", _yaml(tmp_path)] + FLAGS
    args += ["--outer-start-iter", "2"]
    ranks = run_ranks(_job, 4, args, timeout_s=300)
    cfg = load_config(args)
    workload = workload_of_config(cfg)
    shapes = shapes_of_config(cfg.model, bucket_numel=workload.bucket_numel)
    whole = _cluster(cfg)
    synchronous = plan(shapes, workload, whole, fixed_zeropp=ZeroPP()).choice.option.strategy.name
    log = ranks[0]["log"]
    planned = [m.group(1) for m in (re.search(r"paro_strategy auto -> (\w+) \(runner-up", line) for line in log) if m]
    islands = [m.group(1) for m in (re.search(r"auto with islands -> (\w+) in each", line) for line in log) if m]
    assert planned == [synchronous] and islands == [_expected(args)], log
    assert sorted(ranks[0]["losses"]) == [1, 2, 3, 4]
