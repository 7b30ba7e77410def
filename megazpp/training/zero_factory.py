"""Build a ZeroEngine from the run's checked options (`config.options.RunOptions`).

Why a separate function: under `paro_strategy: auto` and `hierarchical: auto` the planner
decides in the ranks, where it can probe the links and the device (collectively), and the
engine gets those decisions as data: the strategy through `ZeroOptions.chosen` (only among those
the options allow), the per-kind hierarchy as a `Hierarchy`. The options themselves were mapped
and checked by `config.checks.check_config` before the ranks started (and again by each rank's
start); nothing here parses a setting again, but the options the decisions make are rebuilt
through `ZeroOptions`, whose constructor checks them again, and the planner refuses a `planner`
section that neither gives nor lets it probe a quantity it needs. The engine repeats two of the
config's rules for callers that build it without the config (frozen parameters against the
strategy, a pipeline-tied embedding against sharded gradients).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from megazpp.config.options import RunOptions
from megazpp.errors import required
from megazpp.model.gpt import GPTModel
from megazpp.parallel.topology import Topology
from megazpp.planner.auto import auto_hierarchy, auto_strategy
from megazpp.zero.strategy import PlannerChoice
from megazpp.zero.zero_engine import ZeroEngine


def build_zero_engine(
    model: GPTModel,
    options: RunOptions,
    topology: Topology,
    counts_in_norm: Callable[[str, nn.Parameter], bool] | None = None,
) -> ZeroEngine:
    """The engine for `model` (built in fp32, like LocalEngine's) under `options` on `topology`;
    `counts_in_norm` as for LocalEngine (the pipeline's rule that skips a tied duplicate).
    `paro_strategy: auto` asks the planner (collective: every rank gets rank 0's choice) to pick
    among the strategies `options.zero` allows, and so does `hierarchical: auto`: the engine gets
    the planner's per-kind decision as data. With `topology` an island view (two-level
    training's islands) auto prices each island option as the two-level job it makes; over all
    DP ranks (the synchronous phase before `outer.start_iter` too) as a synchronous job.
    The planner reads the whole checked config (the model's shapes and the workload)."""
    cfg, zero = options.config, options.zero
    cluster = None
    if isinstance(zero.strategy, PlannerChoice):
        choice = auto_strategy(model, cfg, topology, cfg.planner, zero, options.outer if topology.islands > 1 else None)
        cluster = choice.cluster
        zero = zero.chosen(choice.strategy)
    if zero.hierarchical == "auto":
        hier = auto_hierarchy(model, cfg, zero, topology, cluster)
        if hier is not None:
            zero = dataclasses.replace(zero, hierarchy=hier)
    return ZeroEngine(
        model,
        options.optimizer,
        options.precision,
        zero,
        topology,
        counts_in_norm=counts_in_norm,
        tied_embeddings=required(cfg.model.tie_embeddings, "model.tie_embeddings"),
        tied_weight=model.tied_embedding_weight(),
    )
