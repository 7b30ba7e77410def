"""Build a ZeroEngine from the run's checked options (`config.options.RunOptions`).

Why a separate function: under `paro_strategy: auto` and `hierarchical: auto` the planner
decides once the ranks can measure their links, and the engine should get those decisions as
data. Everything else was mapped and checked before any rank started (`config.checks.
check_config`); nothing here parses or checks a setting again.
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
    the planner's per-kind decision as data. With `options.outer` (two-level training,
    `topology` an island view) auto prices each island option as the two-level job it makes.
    The planner reads the whole checked config (the model's shapes and the workload)."""
    cfg, zero = options.config, options.zero
    cluster = None
    if isinstance(zero.strategy, PlannerChoice):
        choice = auto_strategy(model, cfg, topology, cfg.planner, zero, options.outer)
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
