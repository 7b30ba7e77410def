"""The planner against a real ZeroEngine on 4 gloo ranks (2 virtual nodes x 2), one spawn.

Memory: for all 14 strategies (and ZeRO++ combinations) the planner's model-state bytes per
rank equal the bytes of the tensors the engine holds after a step (`ZeroEngine.held_bytes`),
and its per-step bytes equal what the comm counter recorded. The configuration is the one
of tests/test_zero_engine.py (tiny Llama, reduce_bucket_size 4000, 2 micro-batches, fp32; one
LoCo run in fp16, whose error buffers keep a copy for skipped steps); fetch groups are kept from
forward to backward (the default budget) except in two runs with `stage3_max_live_parameters: 0`;
two ZeRO++ runs keep parameters below `stage3_param_persistence_threshold` whole;
four runs with activation checkpointing (GGG, IIG, ZeRO++ with hpZ, qwZ alone) check that the
recompute fetches nothing.
Auto: `auto_strategy` returns the same strategy on every rank, with probed bandwidths (which
differ per rank until rank 0's are broadcast) and with given ones, and equals the plan
computed here from the same inputs; `build_zero_engine` runs it for `paro_strategy: auto`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support import TINY_LLAMA, zero_keys

from megazpp.config.checks import check_config
from megazpp.config.planner import PlannerSettings
from megazpp.config.schema import Config
from megazpp.errors import ConfigError
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel.counter import counter
from megazpp.parallel.topology import Topology
from megazpp.planner.auto import auto_hierarchy, auto_strategy, choose_strategy
from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.cost import fastest_hierarchy, layout, reused_groups, stage_padded
from megazpp.planner.plan import Option, predict
from megazpp.planner.shape import shape_of_model, shapes_of_config
from megazpp.planner.workload import Workload, workload_of_config
from megazpp.training.zero_factory import build_zero_engine
from megazpp.zero.options import ZeroOptions
from megazpp.zero.sequences import Hierarchy
from megazpp.zero.strategy import VALID_NAMES, parse_strategy
from megazpp.zero.traffic import choose_hierarchy
from megazpp.zero.zero_engine import ZeroEngine
from megazpp.zero.zeropp import ZeroPP

MICRO, BUCKET = 2, 4000
BLOCKS = dict(qwz_block=256, qgz_block=128)
FP32, FP16 = PrecisionOptions(), PrecisionOptions(fp16=True)
LIVE = 10**9  # zero.stage3_max_live_parameters: the default keeps every group for backward
# (strategy, ZeRO++, precision, activation checkpointing, max live parameters)
RUNS = [(name, ZeroPP(), FP32, False, LIVE) for name in VALID_NAMES] + [
    ("GGG", ZeroPP(qwz=True, hpz=2, qgz=True, **BLOCKS), FP32, False, LIVE),
    ("IIG", ZeroPP(qgz=True, **BLOCKS), FP32, False, LIVE),
    ("NGG", ZeroPP(qgz=True, loco=True, **BLOCKS), FP32, False, LIVE),
    ("GGG", ZeroPP(qgz=True, loco=True, **BLOCKS), FP16, False, LIVE),
    ("GGG", ZeroPP(), FP32, True, LIVE),
    ("IIG", ZeroPP(), FP32, True, LIVE),
    ("GGG", ZeroPP(qwz=True, hpz=2, qgz=True, **BLOCKS), FP32, True, 0),
    ("IIG", ZeroPP(qwz=True, **BLOCKS), FP32, True, 0),
]
# a ring step inside a node dearer than three across: the latency model prices one stage over
# DP (3 steps across) below two stages (1 step across + 1 inside) for these tiny groups
SLOW_INTRA_STEP = PlannerSettings(
    intra_node_gbs=1.0, inter_node_gbit=10, intra_node_latency_us=3000, inter_node_latency_us=100
)
# ZeRO++ with stage3_param_persistence_threshold: the norm gains (32 elements) kept whole
PERSISTENCE = 100
PERSIST_RUNS = [
    ("GGG", ZeroPP(qwz=True, hpz=2, qgz=True, **BLOCKS), FP32, False, LIVE),
    ("IGG", ZeroPP(qgz=True, loco=True, **BLOCKS), FP32, True, LIVE),
]
ALL_RUNS = [(run, 0) for run in RUNS] + [(run, PERSISTENCE) for run in PERSIST_RUNS]
GIVEN = PlannerSettings(accelerator_memory_gib=0.0003, achievable_tflops=0.01, intra_node_gbs=1.0, inter_node_gbit=0.1)


def _config() -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**TINY_LLAMA)
    cfg.training = dataclasses.replace(cfg.training, micro_batch_size=MICRO, global_batch_size=MICRO * 4 * 2)
    cfg.zero = ZeroOptions(reduce_bucket_size=BUCKET)
    return cfg


def _one_step(model: GPTModel, engine: ZeroEngine, topo: Topology) -> tuple[int, int]:
    counter.reset_step()
    for micro in range(MICRO):
        g = torch.Generator().manual_seed(10 * micro + topo.dp_rank)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (MICRO, TINY_LLAMA["seq_length"] + 1), generator=g)
        engine.scale_loss(model(ids[:, :-1], ids[:, 1:]).mean() / MICRO).backward()
    engine.step()
    rows = [
        r for tag, r in counter.step_totals()["tags"].items() if tag.startswith("zero/") or tag == "train/grad_norm"
    ]
    return sum(r["intra"] for r in rows), sum(r["inter"] for r in rows)


def _rank() -> dict:
    topo = Topology.from_env(ranks_per_node=2)
    out = {"runs": []}
    for (name, zpp, precision, checkpointing, live), persistence in ALL_RUNS:
        model = GPTModel(ModelConfig(**TINY_LLAMA, activation_checkpointing=checkpointing))
        shape = shape_of_model(
            model, bucket_numel=BUCKET, threshold=0, layers=TINY_LLAMA["num_layers"], persistence=persistence
        )
        engine = ZeroEngine(
            model,
            OptimizerOptions(lr=1e-2),
            precision,
            ZeroOptions(
                paro_strategy=name,
                micro_batches_per_step=MICRO,
                reduce_bucket_size=BUCKET,
                stage3_max_live_parameters=live,
                **zero_keys(zpp),
                stage3_param_persistence_threshold=persistence,
            ),
            topo,
        )
        counted = _one_step(model, engine, topo)
        out["runs"].append({"shape": shape, "held": engine.held_bytes(), "counted": counted})
    model = GPTModel(ModelConfig(**TINY_LLAMA))
    anything = ZeroOptions(paro_strategy="auto")  # paro_strategy auto: every strategy allowed
    out["probed"] = auto_strategy(
        model, _config(), topo, PlannerSettings(probe=True, accelerator_memory_gib=0.001), anything
    )
    out["given"] = auto_strategy(model, _config(), topo, GIVEN, anything)
    cfg = _config()  # the engine factory's hook: `paro_strategy: auto` with a `planner` section
    cfg.zero, cfg.planner = dataclasses.replace(cfg.zero, paro_strategy="auto", stage=3), GIVEN
    out["factory"] = build_zero_engine(GPTModel(ModelConfig(**TINY_LLAMA)), check_config(cfg, 4), topo).strategy.name
    cfg = _config()  # `hierarchical: auto` priced on the section's links: the engine runs the planner's choice
    cfg.zero, cfg.planner = dataclasses.replace(cfg.zero, stage=3), SLOW_INTRA_STEP
    model = GPTModel(ModelConfig(**TINY_LLAMA))
    engine = build_zero_engine(model, check_config(cfg, 4), topo)
    counted = _one_step(model, engine, topo)
    calls = sum(
        r["calls"]
        for tag, r in counter.step_totals()["tags"].items()
        if tag.startswith("zero/") or tag == "train/grad_norm"
    )
    out["hier"] = {
        "engine": engine.hier,
        "counted": (counted, calls),
        "formulas": (engine.expected_step_bytes(MICRO), engine.expected_step_calls(MICRO)),
    }
    try:
        auto_strategy(model, _config(), topo, PlannerSettings(accelerator_memory_gib=1), anything)
        out["refused"] = ""
    except ConfigError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4, timeout_s=300)


def _workload(fp16: bool = False, checkpointing: bool = False, live: int = LIVE, persistence: int = 0) -> Workload:
    return Workload(
        model=ModelConfig(**TINY_LLAMA, activation_checkpointing=checkpointing),
        micro_batch=MICRO,
        global_batch=MICRO * 4 * 2,
        param_bytes=2 if fp16 else 4,
        fp16=fp16,
        accum_bytes=4,
        bucket_numel=BUCKET,
        activation_checkpointing=checkpointing,
        max_live_parameters=live,
        persistence_threshold=persistence,
    )


def test_planner_memory_and_bytes_equal_the_engine(results):
    cluster = Cluster(
        nodes=2, gpus_per_node=2, memory_bytes=GIB, flops=1e10, intra_bw=1e9, inter_bw=1e8, backend="gloo"
    )  # the engines ran on gloo: the planner prices its links
    from_config = {
        p: shapes_of_config(ModelConfig(**TINY_LLAMA), bucket_numel=BUCKET, persistence=p)[0] for p in (0, PERSISTENCE)
    }
    persisting, plain = from_config[PERSISTENCE], from_config[0]
    assert persisting.persistent == 1 and persisting.fetch_groups[-1] == 5 * TINY_LLAMA["hidden_size"]  # 5 norm gains
    assert sum(persisting.fetch_groups) == sum(plain.fetch_groups)
    for rank, report in enumerate(results):
        for ((name, zpp, precision, checkpointing, live), persistence), run in zip(ALL_RUNS, report["runs"]):
            # the meta-device build sees the same groups
            assert run["shape"] == from_config[persistence], (name, rank)
            workload = _workload(precision.fp16, checkpointing, live, persistence)
            stage = predict(Option(parse_strategy(name), zpp), [run["shape"]], workload, cluster).stages[0]
            assert stage.state == run["held"], (name, zpp, rank, stage.state, run["held"])
            assert stage.step_bytes == run["counted"], (name, zpp, rank, stage.step_bytes, run["counted"])


def test_auto_choice_is_identical_on_every_rank(results):
    for key in ("probed", "given"):
        names = {(r[key].strategy.name, r[key].runner_up) for r in results}
        assert len(names) == 1, (key, names)
        clusters = {r[key].cluster for r in results}
        assert len(clusters) == 1, key  # rank 0's measurements were broadcast
    # the given settings reproduce here, from the same shape, workload and cluster
    given = results[0]["given"]
    shape = results[0]["runs"][0]["shape"]
    local = choose_strategy([shape], workload_of_config(_config()), given.cluster)
    assert (local.strategy, local.runner_up) == (given.strategy, given.runner_up)
    assert given.cluster.inter_bw == pytest.approx(0.1e9 / 8) and given.cluster.nodes == 2
    # 0.3 MiB: the replicated strategies' fp32 state does not fit, so the choice shards something
    assert given.strategy.name != "NNN" and not given.plan.rows[-1].fits
    assert {r["factory"] for r in results} == {given.strategy.name}  # stage 3 yields to auto
    assert all(r["refused"].startswith("zero.paro_strategy = auto: set planner.achievable_tflops") for r in results)
    probed = results[0]["probed"].cluster
    assert probed.intra_bw > 0 and probed.inter_bw > 0 and probed.flops > 0
    # CPU ranks: the host model (cores move the bytes), with every op probed on every DP group
    assert not probed.overlap and probed.backend == "gloo" and probed.optimizer_rate > 0
    assert sorted(probed.collective_times) == sorted(
        f"{op}/{g}" for op in ("all_gather", "reduce_scatter", "all_reduce") for g in ("cross", "dp", "hpz", "intra")
    )
    assert all(len(points) == 3 for points in probed.collective_times.values())
    assert all(r["probed"].cluster.collective_times == probed.collective_times for r in results)  # rank 0's
    assert dataclasses.replace(probed, flops=1.0) != probed


def test_hierarchical_auto_runs_the_planners_choice(results):
    """The builder hands the engine the planner's per-kind choice (here one stage, where the
    byte rule would take two); the engine's counted bytes and calls equal the formulas for it."""
    cfg = _config()
    cfg.zero = dataclasses.replace(cfg.zero, stage=3)
    settings = SLOW_INTRA_STEP
    cluster = Cluster(
        nodes=2,
        gpus_per_node=2,
        memory_bytes=math.inf,
        flops=math.inf,
        intra_bw=settings.intra_node_gbs * 1e9,
        inter_bw=settings.inter_node_gbit * 1e9 / 8,
        intra_latency=settings.intra_node_latency_us * 1e-6,
        inter_latency=settings.inter_node_latency_us * 1e-6,
        backend="gloo",
        overlap=False,
    )
    workload = workload_of_config(cfg)
    ggg = parse_strategy("GGG")
    lay = layout(workload, cluster)
    padded = [n for n, _ in stage_padded(ggg, ZeroPP(), results[0]["runs"][0]["shape"], lay)]
    expected = fastest_hierarchy(ggg, ZeroPP(), padded, lay, workload, cluster, reused_groups(ggg, workload, padded))
    assert expected == Hierarchy() != choose_hierarchy(lay.shapes, "auto")
    for rank, report in enumerate(results):
        run = report["hier"]
        assert run["engine"] == expected, (rank, run["engine"])
        assert run["counted"] == run["formulas"], (rank, run)


def test_hierarchical_auto_on_an_island_prices_the_islands_share_of_the_batch(monkeypatch):
    """Two islands of 2 nodes x 2 ranks (8 ranks): an island's engine runs 4 DP ranks and each
    island reads half of every global batch, so a DP rank runs 32 / 2 / (2 x 4) = 2
    micro-batches per step, not the 4 that the whole job's batch over one island's ranks gives."""
    cfg = Config()
    cfg.model = ModelConfig(**TINY_LLAMA)
    cfg.training = dataclasses.replace(cfg.training, micro_batch_size=2, global_batch_size=32)
    island = Topology(
        rank=0, world_size=4, tp=1, pp=1, dp=4, ranks_per_node=2, islands=2,
        dp_ranks=[0, 1, 2, 3], dp_intra_ranks=[0, 1], dp_inter_ranks=[0, 2],
    )  # fmt: skip
    cluster = Cluster(nodes=2, gpus_per_node=2, memory_bytes=GIB, flops=1e12, intra_bw=1e9, inter_bw=1e8)
    seen = []

    def priced(strategy, zpp, padded, lay, workload, cluster, *rest):
        seen.append(workload.micro_batches(cluster))
        return Hierarchy(gather=True, reduce=True)

    monkeypatch.setattr("megazpp.planner.auto.fastest_hierarchy", priced)
    monkeypatch.setattr("megazpp.planner.auto.hierarchy_seconds", lambda *args: {})
    zero = ZeroOptions(paro_strategy="GGG", paro_group_size=2)
    assert auto_hierarchy(GPTModel(cfg.model), cfg, zero, island, cluster) == Hierarchy(gather=True, reduce=True)
    assert seen == [2]
