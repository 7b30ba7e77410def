"""Planner cost model: byte phases = traffic.step_bytes, hand-computed memory / time / fit, sorting.

Everything here is single-process arithmetic; the comparison with a real engine on 4 gloo
ranks is tests/test_planner_engine.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support import TINY_LLAMA, load_tool

from megazpp.config.load import load_config
from megazpp.errors import ConfigError, TopologyError
from megazpp.model.config import ModelConfig
from megazpp.planner.activations import layer_bytes, stage_activation_bytes
from megazpp.planner.cluster import Cluster
from megazpp.planner.cost import (
    ADAM_TRAFFIC_FP32,
    fastest_hierarchy,
    layout,
    phases,
    predict_stage,
    reused_groups,
    stage_padded,
)
from megazpp.planner.plan import options, plan, predict
from megazpp.planner.shape import StageShape, shapes_of_config
from megazpp.planner.workload import Workload, workload_of_config
from megazpp.zero import memory, sequences, traffic
from megazpp.zero.layout import padded_numel
from megazpp.zero.strategy import VALID_STRATEGIES, Level, parse_strategy
from megazpp.zero.zeropp import ZeroPP

plan_cli = load_tool("plan")

TINY = ModelConfig(**TINY_LLAMA)


def _cluster(nodes: int, gpus: int, **kw) -> Cluster:
    base = dict(
        nodes=nodes,
        gpus_per_node=gpus,
        memory_bytes=1e12,
        flops=1e12,
        intra_bw=1e10,
        inter_bw=1e9,
        intra_latency=1e-5,
        inter_latency=1e-4,
        memory_bw=1e11,
    )
    return Cluster(**{**base, **kw})


@pytest.mark.parametrize("nodes,gpus,tp", [(2, 2, 1), (2, 4, 1), (4, 4, 2), (1, 4, 1), (4, 1, 1)])
def test_phases_add_up_to_formulas_step_bytes(nodes, gpus, tp):
    """The planner's per-phase bytes (for overlap) are exactly what traffic.step_bytes sums."""
    cluster = _cluster(nodes, gpus)
    workload = Workload(model=TINY, micro_batch=1, global_batch=3 * nodes * gpus // tp, tp=tp)
    numels = [1000, 4096, 77]
    for opt in options(workload, cluster):
        lay = layout(workload, cluster, opt.zeropp.hpz)
        padded = [padded_numel(n, lay.dp_size, opt.zeropp.alignment()) for n in numels]
        reused = (True, False, True)  # kept groups: fetched once per step, not per forward and backward
        ph = phases(opt.strategy, padded, lay, opt.zeropp, workload, 3, cluster, reused)
        norm = traffic.step_bytes(
            opt.strategy,
            [],
            lay.shapes,
            lay.hier,
            micro_batches=3,
            param_bytes=2,
            accum_bytes=4,
            extra_norm_groups=lay.extra_norm_groups,
        )
        ours = (
            sum(p.intra * p.times for p in ph.values()) + norm[0],
            sum(p.inter * p.times for p in ph.values()) + norm[1],
        )
        assert ours == traffic.step_bytes(
            opt.strategy,
            padded,
            lay.shapes,
            lay.hier,
            micro_batches=3,
            param_bytes=2,
            accum_bytes=4,
            extra_norm_groups=lay.extra_norm_groups,
            zeropp=opt.zeropp,
            reused=reused,
        ), (opt.name, nodes, gpus)
        if (
            opt.zeropp.hpz == 1 and opt.strategy.params != Level.N
        ):  # the group not kept: a fetch per forward and backward
            assert ph["fetch_backward"].calls == ph["fetch_forward"].calls, opt.name
            assert ph["fetch_forward_once"].calls == 2 * ph["fetch_forward"].calls, opt.name
            assert (ph["fetch_forward"].times, ph["fetch_forward_once"].times) == (3, 1), opt.name


def test_zeropp_options_only_where_they_act():
    names = {o.name for o in options(Workload(model=TINY, micro_batch=1, global_batch=4), _cluster(2, 2))}
    assert len({n.split("+")[0] for n in names}) == 14
    assert "GGG+qwZ+hpZ2+qgZ" in names and "NGG+qgZ" in names and "IIG+qwZ" in names
    assert not any(n.startswith("NN") and "+" in n for n in names)  # nothing to compress
    assert not any("hpZ" in n and not n.startswith("G") for n in names)
    tied_pp = options(
        Workload(model=TINY, micro_batch=1, global_batch=4),
        _cluster(2, 2),
        ZeroPP(),
        allowed=lambda s: s.grads.name == "N",
    )
    assert sorted(o.name for o in tied_pp) == ["GNG", "ING", "INI", "NNG", "NNI", "NNN"]
    one_rank = options(Workload(model=TINY, micro_batch=1, global_batch=1), _cluster(1, 1))
    assert [o.name for o in one_rank] == [s.name for s in VALID_STRATEGIES]


def test_activation_formula_by_hand():
    s, b, h, a = 8, 2, 32, 4
    assert layer_bytes(TINY, 2, 1, False, flash_attention=False) == s * b * h * (34 + 5 * a * s / h)
    assert layer_bytes(TINY, 2, 2, False, flash_attention=True) == s * b * h * (10 + 24 / 2)
    assert layer_bytes(TINY, 2, 2, True, flash_attention=True) == s * b * h * 34 / 2
    # 1F1B: stage 0 of 2 keeps 2 micro-batches of its layer; checkpointing keeps inputs + one layer
    full = s * b * h * 34
    assert (
        stage_activation_bytes(
            TINY,
            micro_batch=2,
            micro_batches=4,
            tp=1,
            pp=2,
            stage=0,
            layers=1,
            sequence_parallel=False,
            flash_attention=True,
            checkpointing=False,
        )
        == 2 * full
    )
    assert (
        stage_activation_bytes(
            TINY,
            micro_batch=2,
            micro_batches=4,
            tp=1,
            pp=2,
            stage=1,
            layers=1,
            sequence_parallel=False,
            flash_attention=True,
            checkpointing=True,
        )
        == 2 * s * b * h + full + 2 * 4 * s * b * 96
    )


def test_ddp_on_two_single_gpu_nodes_by_hand():
    """NNN, D = 2 across nodes, one bucket: every term of the step written out."""
    cluster = _cluster(2, 1)
    workload = Workload(model=TINY, micro_batch=2, global_batch=8, param_bytes=2, accum_bytes=4)  # A = 2
    shape = StageShape(0, fetch_groups=(1000,), buckets=(1000,), frozen=0, layers=2, first=True, last=True)
    nnn = parse_strategy("NNN")
    p = predict_stage(nnn, ZeroPP(), shape, workload, cluster, layout(workload, cluster))
    psi = 1000  # already a multiple of D = 2
    assert p.state == memory.StateBytes(2 * psi, 4 * psi, 12 * psi)
    assert p.step_bytes == (0, 4 * psi)  # all-reduce of 4-byte grads over 2 ranks: 2 N / 2 from the peer
    t_f = TINY.seq_length * 2 * (6 * (2 * (32 * 64 + 32 * 32 + 3 * 32 * 40) + 96 * 32) + 12 * 2 * 8 * 4 * 8) / 3 / 1e12
    t_acc = psi * (2 + 2 * 4) / 1e11
    assert p.compute_s == pytest.approx(2 * (t_f + 2 * t_f) + 2 * t_acc, rel=1e-12)
    boundary = 2 * 1e-4 + 4 * psi / 1e9  # 2 ring steps of inter latency + bytes over the node link
    assert p.exposed["backward_comm"] == pytest.approx(boundary)  # one bucket: nothing hides it
    assert p.exposed["fetch_forward"] == 0 and p.exposed["refresh"] == 0 and p.exposed["norm"] == 0
    assert p.exposed["optimizer"] == pytest.approx(psi * (ADAM_TRAFFIC_FP32 + 2) / 1e11)
    assert p.step_s == pytest.approx(p.compute_s + boundary + psi * 30 / 1e11)
    assert p.memory_bytes == 18 * psi + stage_activation_bytes(
        TINY,
        micro_batch=2,
        micro_batches=2,
        tp=1,
        pp=1,
        stage=0,
        layers=2,
        sequence_parallel=False,
        flash_attention=True,
        checkpointing=False,
    )


def _shape(numel: int) -> list[StageShape]:
    return [StageShape(0, (numel,), (numel,), 0, 2, True, True)]


def test_fit_sorting_and_recommendation():
    """A memory limit between GGG's and NNN's footprint: fitting rows first, fastest first, and
    the choice is the fastest that fits; when nothing fits, the reason says so."""
    workload = Workload(model=TINY, micro_batch=1, global_batch=4)
    shapes = _shape(4_000_000)
    base = _cluster(2, 2)
    rows = {o.name: predict(o, shapes, workload, base) for o in options(workload, base, ZeroPP())}
    limit = (rows["GGG"].memory_bytes + rows["NNN"].memory_bytes) / 2
    cluster = dataclasses.replace(base, memory_bytes=limit, usable_memory_fraction=1.0)
    result = plan(shapes, workload, cluster, fixed_zeropp=ZeroPP(), tie=0.0)
    fits = [r.fits for r in result.rows]
    assert fits == sorted(fits, reverse=True) and "NNN" not in [r.name for r in result.rows if r.fits]
    fitting = [r for r in result.rows if r.fits]
    assert [r.step_s for r in fitting] == sorted(r.step_s for r in fitting)
    assert result.choice is fitting[0] and result.runner_up is fitting[1]
    assert all(r.fits == (r.memory_bytes <= limit) for r in result.rows)
    assert result.choice.name in result.reason and result.runner_up.name in result.reason
    tiny = dataclasses.replace(cluster, memory_bytes=rows["GGG"].memory_bytes / 2)
    none = plan(shapes, workload, tiny, fixed_zeropp=ZeroPP())
    assert none.choice is None and "nothing fits" in none.reason


def test_near_tie_prefers_the_smaller_footprint():
    """With the network far faster than compute, every option is within the margin: the
    choice is the fastest of those within 5 % of the usable memory of the least footprint;
    with no margin it is the fastest."""
    workload = Workload(model=TINY, micro_batch=1, global_batch=4)
    fast = _cluster(2, 2, intra_bw=1e15, inter_bw=1e15, intra_latency=0, inter_latency=0, flops=1e6)
    shapes = _shape(100_000)
    loose = plan(shapes, workload, fast, fixed_zeropp=ZeroPP(), tie=0.02)
    limit = max(r.memory_bytes for r in loose.rows)
    cluster = dataclasses.replace(fast, memory_bytes=limit, usable_memory_fraction=1.0)
    tied = plan(shapes, workload, cluster, fixed_zeropp=ZeroPP(), tie=0.02)
    least = min(r.memory_bytes for r in tied.rows)
    small = [r for r in tied.rows if r.memory_bytes <= least + 0.05 * limit]
    assert tied.choice is small[0] and len(small) < len(tied.rows)
    assert loose.choice is loose.rows[0]  # a huge memory: every saving is below 5 %, the fastest wins
    strict = plan(shapes, workload, cluster, fixed_zeropp=ZeroPP(), tie=0.0)
    assert strict.choice is strict.rows[0]


def test_slow_inter_node_link_prefers_intra_group_sharding():
    """PaRO's point: on a 1 Gbit/s node link with fast NVLink, a strategy that keeps the
    per-micro-batch traffic inside the node (I levels) beats ZeRO-3 (GGG), and with 16
    micro-batches reducing gradients inside the node (NIG) beats reducing them globally (NGG)."""
    workload = Workload(model=TINY, micro_batch=1, global_batch=512)
    cluster = _cluster(4, 8, inter_bw=1.25e8, intra_bw=3e11, flops=1e14)
    rows = {r.name: r for r in plan(_shape(50_000_000), workload, cluster, fixed_zeropp=ZeroPP()).rows}
    assert rows["IIG"].step_s < rows["GGG"].step_s and rows["NIG"].step_s < rows["NGG"].step_s


def test_config_shapes_match_parameter_count_and_tp_split():
    from megazpp.model.flops import parameter_count

    one = shapes_of_config(TINY, bucket_numel=4000)
    assert sum(one[0].fetch_groups) == sum(one[0].buckets) == parameter_count(TINY)
    two = shapes_of_config(TINY, tp=2, bucket_numel=4000)
    norms = 2 * 2 * 32 + 32  # two norms per layer + the final norm stay whole on every TP rank
    assert sum(two[0].fetch_groups) == (parameter_count(TINY) - norms) // 2 + norms
    stages = shapes_of_config(TINY, pp=2, bucket_numel=4000)
    assert [s.layers for s in stages] == [1, 1] and sum(sum(s.fetch_groups) for s in stages) == parameter_count(TINY)
    peft = shapes_of_config(TINY, trainable_fraction=0.01, bucket_numel=4000)
    assert sum(peft[0].fetch_groups) + peft[0].frozen == parameter_count(TINY) and peft[
        0
    ].frozen > 0.9 * parameter_count(TINY)
    with pytest.raises(TopologyError, match="not divisible by tensor_model_parallel_size = 3"):
        shapes_of_config(TINY, tp=3)


def test_bad_cluster_and_batch_are_config_errors():
    with pytest.raises(ConfigError, match="cluster.inter_bw"):
        _cluster(2, 2, inter_bw=0)
    with pytest.raises(ConfigError, match="global batch 6"):
        Workload(model=TINY, micro_batch=1, global_batch=6).micro_batches(_cluster(2, 2))
    with pytest.raises(ConfigError, match="paro_group_size = 3: expected a positive divisor"):
        layout(Workload(model=TINY, micro_batch=1, global_batch=4, paro_group_size=3), _cluster(2, 2))
    with pytest.raises(ConfigError, match="tensor-parallel size 4 must divide"):
        Workload(model=TINY, micro_batch=1, global_batch=4, tp=4).dp(_cluster(4, 2))


def test_plan_cli_prints_sorted_table_and_recommendation(capsys):
    args = [
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--inter-gbit",
        "1",
        "--memory-gib",
        "1",
        "--tflops",
        "0.05",
        "--intra-gbs",
        "5",
        "--memory-bw-gbs",
        "10",
        "--backend",
        "gloo",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--vocab-size",
        "512",
        "--seq-length",
        "64",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--dtype",
        "fp32",
    ]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    synchronous, two_level = out.split("Two-level options")  # the synchronous table, then the two-level one
    assert "CHANGE THE OPTIMISATION" in two_level
    rows = [line for line in synchronous.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len({r.split("|")[2].split("+")[0].strip(" *<-") for r in rows}) == 14
    times = [float(r.split("|")[-2]) for r in rows]
    assert times == sorted(times) and "Recommendation:" in out and "**<-**" in out
    assert plan_cli.main(["--nodes", "2", "--gpus-per-node", "2", "--inter-gbit", "1", "--num-layers", "2"]) == 2
    assert "--memory-gib" in capsys.readouterr().err


def test_peft_frozen_weights_sharded_at_p():
    """Frozen weights of a fetch group (`frozen_groups`) are held at p and gathered with their
    group, never reduced (as the engine does, and the PaRO paper counts); frozen elements in no
    group stay whole on every rank, with no traffic."""
    cluster = _cluster(2, 2)
    paper_shape = StageShape(
        0,
        fetch_groups=(100, 300),
        buckets=(400,),
        frozen=9600,
        layers=2,
        first=True,
        last=True,
        frozen_groups=(2400, 7200),
    )
    shape = dataclasses.replace(paper_shape, frozen_groups=())
    engine_view = Workload(model=TINY, micro_batch=1, global_batch=12, trainable_fraction=0.04)  # A = 3
    iig = parse_strategy("IIG")
    lay = layout(engine_view, cluster)
    plain = predict_stage(iig, ZeroPP(), shape, engine_view, cluster, lay)
    paper = predict_stage(iig, ZeroPP(), paper_shape, engine_view, cluster, lay)
    assert plain.frozen_bytes == 9600 * 2 and paper.frozen_bytes == 9600 * 2 // 2  # k = 2
    assert plain.state == paper.state
    fetch = traffic.sequence_bytes(sequences.param_fetch_sequence(iig, 2, lay.hier), 9600, 2, lay.shapes)
    # the default reuse budget keeps the groups: fetched once per step for its 3 micro-batches
    assert paper.step_bytes == (plain.step_bytes[0] + fetch[0], plain.step_bytes[1] + fetch[1])
    plain_off, paper_off = (
        predict_stage(iig, ZeroPP(), sh, dataclasses.replace(engine_view, max_live_parameters=0), cluster, lay)
        for sh in (shape, paper_shape)
    )
    assert paper_off.step_bytes == (
        plain_off.step_bytes[0] + 2 * 3 * fetch[0],
        plain_off.step_bytes[1] + 2 * 3 * fetch[1],
    )
    nng = predict_stage(parse_strategy("NNG"), ZeroPP(), paper_shape, engine_view, cluster, lay)
    assert nng.frozen_bytes == 9600 * 2  # p = N keeps every weight whole


def test_without_overlap_only_the_link_wait_hides():
    """overlap=False (CPU cores move the bytes): a collective's host part (its call plus its bytes
    at the intra-node rate) is always exposed; only the wait on the slower inter-node link hides
    behind compute."""
    # A = 2 on 2 x 2; flat: one call per unit
    workload = Workload(model=TINY, micro_batch=1, global_batch=8, hierarchical="never")
    shape = StageShape(0, fetch_groups=(4000, 4000), buckets=(8000,), frozen=0, layers=2, first=True, last=True)
    ggg = parse_strategy("GGG")
    slow_compute = _cluster(2, 2, flops=1e3)  # compute far longer than any collective
    lay = layout(workload, slow_compute)
    hidden = predict_stage(ggg, ZeroPP(), shape, workload, slow_compute, lay)
    serial_cluster = dataclasses.replace(slow_compute, overlap=False)
    serial = predict_stage(ggg, ZeroPP(), shape, workload, serial_cluster, lay)
    overlapped = phases(ggg, [4000, 4000], lay, ZeroPP(), workload, 2, slow_compute)
    # the default reuse budget keeps both groups: one fetch per step, its first unit exposed
    assert hidden.exposed["fetch_forward"] == pytest.approx(overlapped["fetch_forward"].seconds / 2)
    ph = phases(ggg, [4000, 4000], lay, ZeroPP(), workload, 2, serial_cluster, (True, True))
    assert ph["fetch_backward"].seconds == ph["fetch_forward"].seconds == 0
    fetch = ph["fetch_forward_once"]
    # two units, each a flat 4-rank all-gather: 3 ring steps at the inter latency, and the bytes
    # received (1 intra peer, 2 inter peers, 1000 parameters each) at the intra rate of 1e10 B/s
    assert fetch.host == pytest.approx(2 * (3 * 1e-4 + 3 * 1000 * workload.param_bytes / 1e10))
    assert 0 < fetch.host < fetch.seconds  # the inter link (1e9 B/s per node) is slower
    assert serial.exposed["fetch_forward"] == pytest.approx(fetch.host)
    back = ph["fetch_backward"] + ph["micro_reduce"]
    assert serial.exposed["backward_comm"] == pytest.approx(2 * back.host + ph["boundary"].host)
    fast = dataclasses.replace(serial_cluster, flops=1e30)  # nothing to hide behind
    exposed = predict_stage(ggg, ZeroPP(), shape, workload, fast, lay).exposed
    assert exposed["fetch_forward"] == pytest.approx(fetch.seconds)
    assert exposed["backward_comm"] == pytest.approx(2 * back.seconds + ph["boundary"].seconds)


def test_planner_settings_refuse_non_positive_values():
    from megazpp.config.planner import PlannerSettings

    PlannerSettings(probe=True)
    with pytest.raises(ConfigError, match="planner.inter_node_gbit = 0"):
        PlannerSettings(inter_node_gbit=0)
    with pytest.raises(ConfigError, match="planner.usable_memory_fraction"):
        PlannerSettings(usable_memory_fraction=1.5)


def test_probed_collective_times_replace_latency_and_bandwidth():
    from megazpp.planner.timing import collective_time, host_time, measured_time

    points = ((1e3, 2e-3), (1e4, 3e-3), (1e6, 5e-2))  # (received bytes, seconds)
    assert measured_time(points, 10) == 2e-3  # never below the smallest message's time
    assert measured_time(points, 5.5e3) == pytest.approx(2.5e-3)
    assert measured_time(points, 2e6) == pytest.approx(5e-2 + (5e-2 - 3e-3) / 99e4 * 1e6)  # last segment
    base = _cluster(2, 2, backend="gloo", overlap=False)
    probed = dataclasses.replace(base, collective_times={"all_gather/dp": points})
    shapes = sequences.dp_shapes([0, 1, 2, 3], 2, 0, 2, backend="gloo")
    gather = sequences.Collective("all_gather", "dp", 1)
    intra, inter, seconds = collective_time(gather, 4000, 4, shapes, probed)
    assert (intra, inter) == (6000, 6000)  # a ring of 4 hops of 3 x 4000 bytes, 2 of them between nodes
    assert seconds == pytest.approx(3e-3 + (5e-2 - 3e-3) * 2000 / 99e4)  # 12000 bytes: on the second segment
    assert host_time(gather, intra, inter, seconds, shapes, probed) == pytest.approx(min(seconds, 2e-3 + 12000 / 1e10))
    _, _, by_link = collective_time(gather, 4000, 4, shapes, base)  # not probed: latency + links in turn
    assert by_link == pytest.approx(3 * 1e-4 + 6000 / 1e10 + 6000 / (1e9 / 2))
    rs = sequences.Collective("reduce_scatter", "dp", 1)  # gloo: an all-reduce on the wire, twice the steps
    assert collective_time(rs, 4000, 4, shapes, base)[2] == pytest.approx(6 * 1e-4 + 2 * (6000 / 1e10 + 6000 / 5e8))


def test_planner_follows_zero_hierarchical():
    """The planner prices the collectives the engine will run: zero.hierarchical reaches it."""
    cluster = _cluster(2, 2)
    workload = Workload(model=TINY, micro_batch=1, global_batch=4)
    assert layout(workload, cluster).hier == sequences.Hierarchy(True, True, True)
    assert layout(dataclasses.replace(workload, hierarchical="never"), cluster).hier == sequences.Hierarchy()


BENCH_YAML = str(Path(__file__).parents[1] / "configs" / "experiments" / "netlab" / "llama_comm_bound.yaml")
CALL_S, COPY_BPS = 2e-3, 0.6e9  # the netlab calibration's gloo on shared cores (planner/timing.py)


def _host_model(inter_gbit: float | None) -> Cluster:
    """2 nodes x 2 CPU ranks as `probe_collectives` sees them: every op on every DP group costs
    CALL_S whatever its size, plus its bytes (twice for gloo's reduce-scatter) at the cores'
    copy rate, the inter-node share no faster than the node's link split over its 2 ranks
    (None: loopback, the cores are the only limit)."""
    shapes = sequences.dp_shapes([0, 1, 2, 3], 2, 0, 2, 2)
    inter_rate = COPY_BPS if inter_gbit is None else min(COPY_BPS, inter_gbit * 1e9 / 8 / 2)
    times = {}
    for name in ("dp", "intra", "cross", "hpz"):
        g = getattr(shapes, name)
        share = g.inter_peers / (g.size - 1)
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            wire = 2 if op == "reduce_scatter" else 1
            times[f"{op}/{name}"] = tuple(
                (b, CALL_S + wire * b * ((1 - share) / COPY_BPS + share / inter_rate)) for b in (4e3, 4e6)
            )
    return _cluster(2, 2, backend="gloo", overlap=False, collective_times=times)


@pytest.mark.parametrize("inter_gbit,two_stage", [(None, False), (10, False), (1, True)])
def test_hierarchical_auto_is_priced_by_the_host_model(inter_gbit, two_stage):
    """On the benchmark model's fetch groups (ZeRO-3, 4 micro-batches, 2 x 2 ranks): where a
    call costs milliseconds and the link is fast, one stage over DP (half the calls) is faster;
    at 1 Gbit/s two stages (half the inter-node bytes) are. Each kind is decided by the step's
    predicted collective seconds, and the prediction prices the collectives so chosen."""
    cfg = load_config(["--config", BENCH_YAML, "--vocab-size", "2048"])
    workload = dataclasses.replace(workload_of_config(cfg), hierarchical="auto")
    cluster = _host_model(inter_gbit)
    ggg, zpp = parse_strategy("GGG"), ZeroPP()
    shape = shapes_of_config(cfg.model, bucket_numel=workload.bucket_numel)[0]
    lay = layout(workload, cluster)
    padded = [n for n, _ in stage_padded(ggg, zpp, shape, lay)]
    assert len(padded) == 10  # embedding, 8 layers, final norm + output layer
    reused = reused_groups(ggg, workload, padded)
    hier = fastest_hierarchy(ggg, zpp, padded, lay, workload, cluster, reused)
    assert (hier.gather, hier.reduce) == (two_stage, two_stage), (inter_gbit, hier)
    seconds = {}
    for h in (sequences.Hierarchy(), sequences.Hierarchy(True, True, True)):
        ph = phases(ggg, padded, dataclasses.replace(lay, hier=h), zpp, workload, 4, cluster, reused)
        seconds[h.gather] = sum(p.seconds * p.times for p in ph.values())
    assert (seconds[True] < seconds[False]) == two_stage
    predicted = predict_stage(ggg, zpp, shape, workload, cluster, lay)
    assert (
        predicted.calls == traffic.step_calls(ggg, padded, lay.shapes, hier, micro_batches=4, reused=reused) - 1
    )  # the norm all-reduce is priced apart
    assert predicted.step_bytes == traffic.step_bytes(
        ggg, padded, lay.shapes, hier, micro_batches=4, param_bytes=4, accum_bytes=4, reused=reused
    )
