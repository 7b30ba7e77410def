"""`paro_strategy: auto`: pick the strategy at start-up from the planner, the same on every rank.

Why gather shapes and broadcast the decision: under pipeline parallelism each stage holds
different parameters, and a choice made from one stage could overflow another; so every
rank's shape is gathered, the plan covers all stages (the slowest sets the step time, the
fullest the fit), and rank 0's choice is what every rank runs. Measured bandwidths differ
from rank to rank, so rank 0's measurements are broadcast before planning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from megazpp.config import Config
from megazpp.errors import ConfigError
from megazpp.parallel import comm
from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.plan import Plan, plan
from megazpp.planner.probe import broadcast_values, probe_host, probe_link, probe_matmul_flops
from megazpp.planner.report import table
from megazpp.planner.settings import PlannerSettings
from megazpp.planner.shape import StageShape, shape_of_model, shapes_of_config
from megazpp.planner.workload import Workload, workload_of_config
from megazpp.zero import formulas
from megazpp.zero.strategy import Level, Strategy, parse_strategy
from megazpp.zero.zeropp import zeropp_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    strategy: Strategy
    runner_up: str | None
    plan: Plan
    cluster: Cluster


def choose_strategy(shapes: list[StageShape], workload: Workload, cluster: Cluster,
                    zeropp: formulas.ZeroPP = formulas.ZeroPP(),
                    allowed: Callable[[Strategy], bool] = lambda s: True) -> Choice:
    """The recommended strategy among those the run's ZeRO++ switches apply to and `allowed`
    accepts (pure, local)."""
    result = plan(shapes, workload, cluster, fixed_zeropp=zeropp, allowed=allowed)
    if result.choice is None:
        raise ConfigError(f"zero.paro_strategy = auto: {result.reason}")
    runner = result.runner_up.option.strategy.name if result.runner_up else None
    return Choice(result.choice.option.strategy, runner, result, cluster)


def _zeropp_of(cfg: Config, topology: Any) -> formulas.ZeroPP:
    """The run's ZeRO++ switches, hpZ lowered to the DP ranks of a node as the engine does."""
    return dataclasses.replace(zeropp_of(cfg.zero),
                               hpz=min(cfg.zero.zero_hpz_partition_size, len(topology.dp_intra_ranks)))


def _allowed(cfg: Config, topology: Any) -> Callable[[Strategy], bool]:
    """The engine accepts only g = N when a tied embedding spans pipeline stages (its sync
    needs the whole accumulated gradient)."""
    if topology.pp > 1 and cfg.model.tie_embeddings:
        return lambda s: s.g == Level.N
    return lambda s: True


def _device_memory(settings: PlannerSettings) -> float:
    if settings.accelerator_memory_gib is not None:
        return settings.accelerator_memory_gib * GIB
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    raise ConfigError("zero.paro_strategy = auto: set planner.accelerator_memory_gib (no CUDA device "
                      "to read it from)")


def _link(given: float | None, key: str, needed: bool, group: Any, size: int, settings: PlannerSettings,
          latency_us: float) -> tuple[float, float]:
    """(bytes/s, latency) of one link: from the settings, else probed, else unused (infinite)."""
    if not needed:
        return math.inf, 0.0  # no collective of this run crosses it
    if given is not None:
        return given, latency_us * 1e-6
    if settings.probe and size > 1:
        found = probe_link(group, size)
        return found.bandwidth, found.latency
    raise ConfigError(f"zero.paro_strategy = auto: set planner.{key} or planner.probe = true")


def measure_cluster(settings: PlannerSettings, topology: Any) -> list[float]:
    """[memory, flops, intra_bw, inter_bw per node, intra_latency, inter_latency] on this rank:
    values from `settings`, the rest probed. Collective when probing: every rank must call it."""
    if settings.achievable_tflops is not None:
        flops = settings.achievable_tflops * 1e12
    elif settings.probe:
        cuda = torch.cuda.is_available()
        flops = probe_matmul_flops(device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    else:
        raise ConfigError("zero.paro_strategy = auto: set planner.achievable_tflops or planner.probe = true")
    dp_intra = len(topology.dp_intra_ranks)
    intra_group, intra_size = ((topology.dp_intra_group, dp_intra) if dp_intra > 1
                               else (topology.tp_group, topology.tp))
    intra = _link(settings.intra_node_gbs and settings.intra_node_gbs * 1e9, "intra_node_gbs",
                  intra_size > 1, intra_group, intra_size, settings, settings.intra_node_latency_us)
    inter_size = len(topology.dp_inter_ranks)
    inter = _link(settings.inter_node_gbit and settings.inter_node_gbit * 1e9 / 8 / topology.ranks_per_node,
                  "inter_node_gbit", topology.num_nodes > 1, topology.dp_inter_group, inter_size, settings,
                  settings.inter_node_latency_us)
    return [_device_memory(settings), flops, intra[0], inter[0] * topology.ranks_per_node, intra[1], inter[1]]


def auto_strategy(model: nn.Module, cfg: Config, topology: Any, settings: PlannerSettings) -> Choice:
    """Collective: every rank calls it and gets rank 0's choice. `model` is this rank's stage."""
    settings.validate()
    workload = workload_of_config(cfg)
    bucket_numel = min(cfg.zero.reduce_bucket_size, cfg.zero.allgather_bucket_size)
    if workload.trainable_fraction < 1:  # frozen weights: that share of every group, as tools/plan.py models it
        shape = shapes_of_config(cfg.model, tp=topology.tp, pp=topology.pp, bucket_numel=bucket_numel,
                                 threshold=cfg.zero.module_granularity_threshold, fetch_mode=cfg.zero.fetch_groups,
                                 trainable_fraction=workload.trainable_fraction)[topology.pp_rank]
    else:
        shape = shape_of_model(model, bucket_numel=bucket_numel, threshold=cfg.zero.module_granularity_threshold,
                               fetch_mode=cfg.zero.fetch_groups, stage=topology.pp_rank,
                               layers=len(range(*topology.layer_range(cfg.model.num_layers))),
                               first=topology.is_first_stage, last=topology.is_last_stage)
    shapes = {s.stage: s for s in comm.all_gather_object(shape, tag="planner/shapes")}
    memory, flops, intra_bw, inter_bw, intra_lat, inter_lat = broadcast_values(measure_cluster(settings, topology))
    cpu = not torch.cuda.is_available()  # gloo on CPU ranks: the cores move the bytes (the host model)
    fits, adam = probe_host(topology) if cpu and settings.probe else (None, None)
    cluster = Cluster(nodes=topology.num_nodes, gpus_per_node=topology.ranks_per_node, memory_bytes=memory,
                      flops=flops, intra_bw=intra_bw, inter_bw=inter_bw, intra_latency=intra_lat,
                      inter_latency=inter_lat, memory_bw=settings.memory_bandwidth_gbs * 1e9,
                      usable_memory_fraction=settings.usable_memory_fraction,
                      backend="gloo" if cpu else "nccl", overlap=not cpu, collective_times=fits,
                      optimizer_rate=adam)
    if workload.global_batch is None:  # Config.validate not run: one micro-batch per DP rank
        workload = dataclasses.replace(workload, global_batch=workload.micro_batch * topology.dp)
    choice = choose_strategy([shapes[s] for s in sorted(shapes)], workload, cluster, _zeropp_of(cfg, topology),
                             _allowed(cfg, topology))
    names = comm.all_gather_object((choice.strategy.name, choice.runner_up), tag="planner/choice")
    name, runner = names[0]
    if topology.rank == 0:
        log.info("zero: paro_strategy auto -> %s (runner-up %s): %s\n%s", name, runner, choice.plan.reason,
                 table(choice.plan))
    if name != choice.strategy.name:
        log.warning("zero: paro_strategy auto: this rank's plan chose %s, running rank 0's %s",
                    choice.strategy.name, name)
        choice = Choice(parse_strategy(name), runner, choice.plan, cluster)
    return choice
