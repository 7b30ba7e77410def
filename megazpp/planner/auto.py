"""`paro_strategy: auto`: pick the strategy at start-up from the planner, the same on every rank.

Why gather shapes and broadcast the decision: under pipeline parallelism each stage holds
different parameters, and a choice made from one stage could overflow another; so every
rank's shape is gathered, the plan covers all stages (the slowest sets the step time, the
fullest the fit), and rank 0's choice is what every rank runs. Measured bandwidths differ
from rank to rank, so rank 0's measurements are broadcast before planning.

With islands (`outer.algorithm: diloco`) auto chooses the strategy each island runs: every
option for the island's DP ranks is priced as the two-level job it makes (`two_level.plan_island`:
the inner step over the island's fast links, probed on the island's own groups, plus the outer
syncs over the link between islands, amortised over H, and the outer state in memory), since
the option's optimizer-state level also sets the outer shard a rank syncs and holds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.config.planner import PlannerSettings
from megazpp.config.schema import Config
from megazpp.errors import ConfigError, required
from megazpp.outer.settings import OuterOptions
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.cost import fastest_hierarchy, hierarchy_seconds, layout, reused_groups, stage_padded
from megazpp.planner.plan import Plan, plan
from megazpp.planner.probe import broadcast_values, probe_host, probe_link, probe_matmul_flops
from megazpp.planner.report import island_table, table, two_level_reason, two_level_table
from megazpp.planner.shape import StageShape, shape_of_model, shapes_of_config
from megazpp.planner.two_level import IslandPlan, OuterChoice, plan_island, plan_two_level
from megazpp.planner.workload import Workload, workload_of_config
from megazpp.zero import sequences
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import PlannerChoice, Strategy, parse_strategy
from megazpp.zero.zeropp import ZeroPP

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    strategy: Strategy
    runner_up: str | None
    plan: Plan | IslandPlan
    cluster: Cluster  # the one the engine's DP groups run on (an island's, with islands)


def choose_strategy(
    shapes: list[StageShape],
    workload: Workload,
    cluster: Cluster,
    zeropp: ZeroPP = ZeroPP(),
    allowed: Callable[[Strategy], bool] = lambda s: True,
) -> Choice:
    """The recommended strategy among those the run's ZeRO++ switches apply to and `allowed`
    accepts (pure, local)."""
    result = plan(shapes, workload, cluster, fixed_zeropp=zeropp, allowed=allowed)
    if result.choice is None:
        raise ConfigError(f"zero.paro_strategy = auto: {result.reason}")
    runner = result.runner_up.option.strategy.name if result.runner_up else None
    return Choice(result.choice.option.strategy, runner, result, cluster)


def choose_island_strategy(
    shapes: list[StageShape],
    workload: Workload,
    island: Cluster,
    islands: int,
    outer: OuterChoice,
    zeropp: ZeroPP = ZeroPP(),
    allowed: Callable[[Strategy], bool] = lambda s: True,
) -> Choice:
    """The strategy each of `islands` islands (on `island`, whose `collective_times` were probed
    on the island's groups) runs under `outer`, for the whole job's `workload` (pure, local)."""
    whole = dataclasses.replace(island, nodes=island.nodes * islands, collective_times=None)
    result = plan_island(
        shapes, workload, whole, outer, fixed_zeropp=zeropp, allowed=allowed, island_times=island.collective_times
    )
    if result.choice is None:
        raise ConfigError(f"zero.paro_strategy = auto with outer.algorithm diloco: {result.reason}")
    runner = result.runner_up.inner.option.strategy.name if result.runner_up else None
    return Choice(result.choice.inner.option.strategy, runner, result, island)


def _zeropp_of(zero: ZeroOptions, topology: Topology) -> ZeroPP:
    """The run's ZeRO++ switches, hpZ lowered to the DP ranks of a node as the engine does."""
    return dataclasses.replace(zero.zeropp, hpz=min(zero.zeropp.hpz, len(topology.dp_intra_ranks)))


def _allowed(zero: ZeroOptions) -> Callable[[Strategy], bool]:
    """The strategies the run's settings allow: `PlannerChoice.allowed`, which `ZeroOptions`
    and the config's cross-section rules (a pipeline-tied embedding, frozen parameters) narrowed
    before any rank started, so the planner cannot pick one the engine would refuse."""
    allowed = zero.strategy.allowed if isinstance(zero.strategy, PlannerChoice) else (zero.strategy,)
    return lambda s: s in allowed


def run_device(model: nn.Module) -> torch.device:
    """The device this rank runs on: its stage's (`pretrain_gpt.pick_device` put it there), where
    the probes' tensors must live (NCCL takes only CUDA tensors)."""
    return next(model.parameters()).device


def _device_memory(settings: PlannerSettings, device: torch.device) -> float:
    if settings.accelerator_memory_gib is not None:
        return settings.accelerator_memory_gib * GIB
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    raise ConfigError("zero.paro_strategy = auto: set planner.accelerator_memory_gib (no CUDA device to read it from)")


def _link(
    given: float | None,
    key: str,
    needed: bool,
    group: ProcessGroup | None,
    size: int,
    settings: PlannerSettings,
    latency_us: float,
    device: torch.device,
) -> tuple[float, float]:
    """(bytes/s, latency) of one link: from the settings, else probed, else unused (infinite)."""
    if not needed:
        return math.inf, 0.0  # no collective of this run crosses it
    if given is not None:
        return given, latency_us * 1e-6
    if settings.probe and size > 1:
        found = probe_link(group, size, device=device)
        return found.bandwidth, found.latency
    raise ConfigError(f"zero.paro_strategy = auto: set planner.{key} or planner.probe = true")


def measure_cluster(
    settings: PlannerSettings, topology: Topology, device: torch.device, across_islands: bool = False
) -> list[float]:
    """[memory, flops, intra_bw, inter_bw per node, intra_latency, inter_latency] on this rank:
    values from `settings`, the rest probed on `device` (`across_islands`: see `measure_links`).
    Collective when probing: every rank must call it."""
    if settings.achievable_tflops is not None:
        flops = settings.achievable_tflops * 1e12
    elif settings.probe:
        cuda = device.type == "cuda"
        flops = probe_matmul_flops(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    else:
        raise ConfigError("zero.paro_strategy = auto: set planner.achievable_tflops or planner.probe = true")
    return [_device_memory(settings, device), flops, *measure_links(settings, topology, device, across_islands)]


def measure_links(
    settings: PlannerSettings, topology: Topology, device: torch.device, across_islands: bool = False
) -> list[float]:
    """[intra_bw, inter_bw per node, intra_latency, inter_latency] on this rank: values from
    `settings`, the rest probed on `device`. With `across_islands` (`topology` an island view) the
    inter-node link is the one between islands, probed on the peer group (the outer syncs'),
    which every rank of a node crosses at once. Collective when probing."""
    dp_intra = len(topology.dp_intra_ranks)
    intra_group, intra_size = (topology.dp_intra_group, dp_intra) if dp_intra > 1 else (topology.tp_group, topology.tp)
    intra = _link(
        settings.intra_node_gbs and settings.intra_node_gbs * 1e9,
        "intra_node_gbs",
        intra_size > 1,
        intra_group,
        intra_size,
        settings,
        settings.intra_node_latency_us,
        device,
    )
    inter_group, inter_size = (
        (topology.peer_group, topology.islands)
        if across_islands
        else (topology.dp_inter_group, len(topology.dp_inter_ranks))
    )
    inter = _link(
        settings.inter_node_gbit and settings.inter_node_gbit * 1e9 / 8 / topology.ranks_per_node,
        "inter_node_gbit",
        topology.num_nodes > 1 or across_islands,
        inter_group,
        inter_size,
        settings,
        settings.inter_node_latency_us,
        device,
    )
    return [intra[0], inter[0] * topology.ranks_per_node, intra[1], inter[1]]


def stage_shape(model: nn.Module, cfg: Config, topology: Topology) -> StageShape:
    workload = workload_of_config(cfg)
    bucket_numel, fraction = workload.bucket_numel, workload.trainable_fraction
    if fraction < 1:  # frozen weights: that share of every group, as tools/plan.py models it
        return shapes_of_config(
            cfg.model,
            tp=topology.tp,
            pp=topology.pp,
            bucket_numel=bucket_numel,
            threshold=cfg.zero.module_granularity_threshold,
            fetch_mode=cfg.zero.fetch_groups,
            trainable_fraction=fraction,
        )[topology.pp_rank]
    return shape_of_model(
        model,
        bucket_numel=bucket_numel,
        threshold=cfg.zero.module_granularity_threshold,
        fetch_mode=cfg.zero.fetch_groups,
        stage=topology.pp_rank,
        layers=len(range(*topology.layer_range(cfg.model.num_layers))),
        first=topology.is_first_stage,
        last=topology.is_last_stage,
        persistence=cfg.zero.stage3_param_persistence_threshold,
    )


def _cluster(
    settings: PlannerSettings, topology: Topology, measured: list[float], device: torch.device, optimizer: bool = True
) -> Cluster:
    """The cluster from rank 0's `measured` [memory, flops, intra_bw, inter_bw, intra_latency,
    inter_latency], with the host model (per-op collective times, and with `optimizer` the
    AdamW rate) of CPU ranks probed when `settings.probe`. Collective; its tensors on `device`."""
    memory, flops, intra_bw, inter_bw, intra_lat, inter_lat = broadcast_values(measured, device=device)
    cpu = device.type == "cpu"  # gloo on CPU ranks: the cores move the bytes (the host model)
    fits, adam = probe_host(topology, optimizer, device=device) if cpu and settings.probe else (None, None)
    return Cluster(
        nodes=topology.num_nodes,
        gpus_per_node=topology.ranks_per_node,
        memory_bytes=memory,
        flops=flops,
        intra_bw=intra_bw,
        inter_bw=inter_bw,
        intra_latency=intra_lat,
        inter_latency=inter_lat,
        memory_bw=settings.memory_bandwidth_gbs * 1e9,
        usable_memory_fraction=settings.usable_memory_fraction,
        backend=_backend(cpu),
        overlap=not cpu,
        collective_times=fits,
        optimizer_rate=adam,
    )


def _backend(cpu: bool) -> str:
    """The backend the ranks run (gloo on GPUs too, under --distributed-backend gloo), whose link
    model the plan prices; the device's default where no process group exists."""
    backend = comm.backend()
    return backend if backend != "none" else ("gloo" if cpu else "nccl")


def _workload(cfg: Config, topology: Topology) -> Workload:
    workload = workload_of_config(cfg)
    if workload.global_batch is None:  # validate_config not run: one micro-batch per DP rank
        micro = required(workload.micro_batch, "training.micro_batch_size")
        workload = dataclasses.replace(workload, global_batch=micro * topology.dp * topology.islands)
    return workload


def auto_strategy(
    model: nn.Module,
    cfg: Config,
    topology: Topology,
    settings: PlannerSettings,
    zero: ZeroOptions,
    outer: OuterOptions | None = None,
) -> Choice:
    """Collective: every rank calls it and gets rank 0's choice, among the strategies `zero`
    allows. `model` is this rank's stage. With `outer` (two-level training), `topology` is this
    rank's `Topology.island_view` and the choice is the islands' strategy
    (`choose_island_strategy`). `settings` were checked with the config."""
    shapes = {s.stage: s for s in comm.all_gather_object(stage_shape(model, cfg, topology), tag="planner/shapes")}
    stages = [shapes[s] for s in sorted(shapes)]
    device = run_device(model)
    cluster = _cluster(
        settings, topology, measure_cluster(settings, topology, device, across_islands=outer is not None), device
    )
    workload = _workload(cfg, topology)
    if outer is None:
        choice = choose_strategy(stages, workload, cluster, _zeropp_of(zero, topology), _allowed(zero))
    else:
        choice = choose_island_strategy(
            stages,
            workload,
            cluster,
            topology.islands,
            OuterChoice.of(outer, workload.optimizer_states),
            _zeropp_of(zero, topology),
            _allowed(zero),
        )
    names = comm.all_gather_object((choice.strategy.name, choice.runner_up), tag="planner/choice")
    name, runner = names[0]
    if topology.rank == 0 and isinstance(choice.plan, IslandPlan):
        log.info(
            "zero: paro_strategy auto with islands -> %s in each of %d islands (runner-up %s), priced as "
            "the two-level job: %s\n%s",
            name,
            topology.islands,
            runner,
            choice.plan.reason,
            island_table(choice.plan),
        )
    elif topology.rank == 0 and isinstance(choice.plan, Plan):
        log.info(
            "zero: paro_strategy auto -> %s (runner-up %s): %s\n%s",
            name,
            runner,
            choice.plan.reason,
            table(choice.plan),
        )
        if cluster.nodes > 1:
            log.info(
                "zero: paro_strategy auto: %s",
                two_level_note(
                    [shapes[s] for s in sorted(shapes)], workload, cluster, choice.plan, _zeropp_of(zero, topology)
                ),
            )
    if name != choice.strategy.name:
        log.warning(
            "zero: paro_strategy auto: this rank's plan chose %s, running rank 0's %s", choice.strategy.name, name
        )
        choice = Choice(parse_strategy(name), runner, choice.plan, choice.cluster)
    return choice


def two_level_note(
    shapes: list[StageShape], workload: Workload, cluster: Cluster, synchronous: Plan, zeropp: ZeroPP
) -> str:
    """The two-level options beside the synchronous choice (never chosen by `auto`: they change
    the optimisation; a user opts in with the `outer` section, whose flags the note gives)."""
    two = plan_two_level(shapes, workload, cluster, fixed_zeropp=zeropp)
    return f"{two_level_reason(two, synchronous)}\n{two_level_table(two, synchronous)}"


def auto_hierarchy(
    model: nn.Module, cfg: Config, zero: ZeroOptions, topology: Topology, cluster: Cluster | None = None
) -> sequences.Hierarchy | None:
    """`zero.hierarchical: auto` for the run's strategy on this rank's stage, priced by the
    planner (`cost.fastest_hierarchy`) on `cluster` (the one `paro_strategy: auto` measured),
    else on the links of the `planner` section: given bandwidths or, with `planner.probe`, the
    probe (on CPU ranks the host model: each op timed on each DP group). None where it has
    neither (the engine then takes the fewer inter-node bytes) or where the choice is moot (one
    node, or a PaRO group of one rank or of all). Collective when probing; every rank gets the
    same answer (rank 0's measurements, the same shapes in a DP group)."""
    settings = cfg.planner
    d, k = topology.dp, zero.paro_group_size or len(topology.dp_intra_ranks)
    if topology.num_nodes == 1 or k in (1, d):
        return None
    if cluster is None:
        if not settings.probe and None in (settings.intra_node_gbs, settings.inter_node_gbit):
            log.info(
                "zero: hierarchical auto by inter-node bytes (no planner.intra_node_gbs / "
                "planner.inter_node_gbit and no planner.probe to price calls with)"
            )
            return None
        # only the links are priced: memory and compute rate play no part in a collective's time
        device = run_device(model)
        cluster = _cluster(
            settings,
            topology,
            [math.inf, math.inf, *measure_links(settings, topology, device)],
            device,
            optimizer=False,
        )
    strategy = zero.resolved
    zpp = _zeropp_of(zero, topology)
    workload = _workload(cfg, topology)
    if topology.islands > 1:  # an island view: its engine reads 1 / islands of every global batch
        workload = dataclasses.replace(workload, global_batch=workload.batches()[1] // topology.islands)
    lay = layout(workload, cluster, zpp.hpz)
    shape = stage_shape(model, cfg, topology)
    padded = [n for n, _ in stage_padded(strategy, zpp, shape, lay)]
    reused = reused_groups(strategy, workload, padded, shape.persistent)
    hier = fastest_hierarchy(strategy, zpp, padded, lay, workload, cluster, reused, shape.persistent)
    seconds = hierarchy_seconds(strategy, zpp, padded, lay, workload, cluster, reused, shape.persistent)
    log.info(
        "zero: hierarchical auto -> %s, from the planner's predicted collective seconds per step "
        "(one stage, two stages) %s on %s",
        hier,
        {kind: (round(flat, 4), round(two, 4)) for kind, (flat, two) in seconds.items()},
        "probed collective times" if cluster.collective_times else "the planner section's links",
    )
    return hier
