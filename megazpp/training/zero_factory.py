"""Build a ZeroEngine from the run's typed Config (the `zero` section, DeepSpeed keys).

Why a separate function: the trainer should not know how DeepSpeed's `zero_optimization`
keys map onto the engine's options, and a key whose non-default value the engine would not
honour must be refused here, naming the key, rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from megazpp.config.schema import Config, ZeroConfig
from megazpp.errors import ConfigError, required
from megazpp.model.gpt import GPTModel
from megazpp.outer.settings import OuterOptions
from megazpp.parallel.topology import Topology
from megazpp.planner.auto import auto_hierarchy, auto_strategy
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import resolve_strategy
from megazpp.zero.units import check_persistence
from megazpp.zero.zero_engine import ZeroEngine
from megazpp.zero.zeropp import check_zeropp, zeropp_of


def zero_options(z: ZeroConfig, micro_batches_per_step: int | None = None) -> ZeroOptions:
    """The engine's options: the section's own names and values, the strategy resolved
    (`paro_strategy` wins over `stage`; both given and disagreeing is an error)."""
    strategy = resolve_strategy(z.paro_strategy, z.stage)
    if not z.reduce_scatter:
        raise ConfigError(
            "zero.reduce_scatter = false: the engine always reduces gradients by "
            "reduce-scatter to their shard level (set it to true)"
        )
    zeropp = zeropp_of(z)
    check_zeropp(zeropp, strategy)
    check_persistence(strategy, z.stage3_param_persistence_threshold)
    same = {
        f.name: getattr(z, f.name)
        for f in dataclasses.fields(ZeroOptions)
        if f.name not in ("strategy", "micro_batches_per_step", "zeropp")
    }
    return ZeroOptions(strategy=strategy.name, micro_batches_per_step=micro_batches_per_step, zeropp=zeropp, **same)


def build_zero_engine(
    model: GPTModel,
    cfg: Config,
    topology: Topology,
    micro_batches_per_step: int | None = None,
    counts_in_norm: Callable[[str, nn.Parameter], bool] | None = None,
    outer: OuterOptions | None = None,
) -> ZeroEngine:
    """The engine for `model` (built in fp32, like LocalEngine's) under `cfg` on `topology`;
    `counts_in_norm` as for LocalEngine (the pipeline's rule that skips a tied duplicate).
    `paro_strategy: auto` asks the planner (collective: every rank gets rank 0's choice), and so
    does `hierarchical: auto`: the engine gets the planner's per-kind decision as data. With
    `outer` (two-level training, `topology` an island view) auto prices each island option as
    the two-level job it makes."""
    cluster = None
    if str(cfg.zero.paro_strategy).lower() == "auto":
        choice = auto_strategy(model, cfg, topology, cfg.planner, outer)
        cluster = choice.cluster
        cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, paro_strategy=choice.strategy.name, stage=0))
    options = zero_options(cfg.zero, micro_batches_per_step)
    if options.hierarchical == "auto":
        hier = auto_hierarchy(model, cfg, topology, cluster)
        options = dataclasses.replace(options, hierarchical=options.hierarchical if hier is None else hier)
    return ZeroEngine(
        model,
        cfg.optimizer,
        cfg.precision,
        options,
        topology,
        counts_in_norm=counts_in_norm,
        tied_embeddings=required(cfg.model.tie_embeddings, "model.tie_embeddings"),
        tied_weight=model.tied_embedding_weight(),
    )
