"""The rules that span sections, checked once per job; the run's resolved options returned.

Why here: each section is its own frozen type and checks its own rules when the loader
builds it (`ModelConfig`, `ZeroOptions`, `ZeroPP`, `OptimizerOptions`, `PrecisionOptions`,
`OuterOptions`, `DataOptions`, `ParallelOptions`, `TrainingOptions`, `CheckpointOptions`,
`LoggingOptions`, `PlannerSettings`). `check_config` adds only the rules no single section can see:
batch sizes against the world, tp / pp against the model, compilation and frozen parameters
against the ZeRO strategy, islands against the world. Each refusal is a `ConfigError` naming
the key, the value and what was expected.

Pure: it writes nothing into the Config it is given; what it resolves (the global batch size,
the warmup in iterations, the `zero` options' micro-batch count and the strategies `auto` may
pick) is in the `RunOptions` it returns, a new checked Config that every part of a rank reads.

Where it runs: `training.startup.prepare`, before any process group, in `run.sh`'s
once-per-job check, which hands its decision to the ranks (`startup.read_handoff`): a rank
checks nothing again. A rank started without run.sh runs `prepare` itself.
"""

from __future__ import annotations

import dataclasses

from megazpp.config.load import validate_types
from megazpp.config.options import RunOptions
from megazpp.config.schema import Config
from megazpp.config.sections import TrainingOptions
from megazpp.errors import ConfigError, TopologyError
from megazpp.model.trainable import trainable_fraction, trainable_rule
from megazpp.outer.fragments import first_sync_after
from megazpp.outer.settings import OuterOptions
from megazpp.parallel.topology import check_model_split, dp_groups, island_layout
from megazpp.zero.frozen import frozen_refusal
from megazpp.zero.options import ZeroOptions, tied_split_refusal
from megazpp.zero.zeropp import hpz_group_size


def check_config(cfg: Config, world_size: int = 1, ranks_per_node: int | None = None) -> RunOptions:
    """Refuse the first inconsistent value; return the run's options: a new Config with the
    global batch size and warmup resolved and the `zero` options told the micro-batch count and
    narrowed by the other sections (`cfg` is left as given). `ranks_per_node`: the launcher's,
    for the `outer` islands (the config's `parallel.ranks_per_node` wins)."""
    validate_types(cfg)
    if world_size % (cfg.tp * cfg.pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {cfg.tp} "
            f"x pipeline_model_parallel_size {cfg.pp}"
        )
    check_model_split(cfg.model, cfg.tp, cfg.pp, sequence_parallel=cfg.parallel.sequence_parallel)
    training = _resolve_batch(cfg.training, cfg.data_parallel_size(world_size))
    training = dataclasses.replace(training, lr_warmup_iters=training.warmup_iters, lr_warmup_fraction=None)
    if cfg.training.trainable:
        trainable_rule(cfg.training.trainable, cfg.model)  # refuses a pattern that matches nothing
    if cfg.checkpoint.save_adapters_only and not (cfg.model.lora_rank or cfg.training.trainable):
        raise ConfigError(
            "checkpoint.save_adapters_only: every parameter trains (model.lora_rank is 0 "
            "and training.trainable is empty), so there is no frozen base to leave out"
        )
    resolved = dataclasses.replace(cfg, training=training)
    zero = dataclasses.replace(cfg.zero, micro_batches_per_step=resolved.num_micro_batches(world_size))
    resolve_outer(cfg, world_size, ranks_per_node)  # the outer rules that span sections
    per_node = cfg.parallel.ranks_per_node or ranks_per_node or world_size
    islands = islands_of(cfg, world_size, ranks_per_node)
    dp = cfg.data_parallel_size(world_size) // islands  # the engine runs over one island's DP ranks
    _check_hpz_nodes(zero.zeropp.hpz, cfg, world_size, per_node, islands)
    return RunOptions(dataclasses.replace(resolved, zero=_zero_across_sections(cfg, zero, dp)), world_size)


def islands_of(cfg: Config, world_size: int, ranks_per_node: int | None) -> int:
    """The run's islands: 1 without two-level training or with elastic islands (each island is
    a job of its own), else the nodes (the config's `parallel.ranks_per_node`, or the launcher's)
    over `outer.island_nodes` per island."""
    if cfg.outer.algorithm == "none" or cfg.outer.elastic:
        return 1
    per_node = cfg.parallel.ranks_per_node or ranks_per_node or world_size
    return max(world_size // per_node // max(cfg.outer.island_nodes, 1), 1)


def validate_config(cfg: Config, world_size: int = 1, ranks_per_node: int | None = None) -> Config:
    """`check_config` for callers that need only the checked config (tools, tests): the
    resolved copy."""
    return check_config(cfg, world_size, ranks_per_node).config


def _check_hpz_nodes(hpz: int, cfg: Config, world_size: int, per_node: int, islands: int) -> None:
    """hpZ's group against the nodes, for every DP group an engine spans and every node it is
    on (`zeropp.hpz_group_size`, the rule the engine resolves its group size by): the one rule
    of the `zero` section that needs the layout of the ranks over the nodes."""
    if hpz <= 1 or world_size % per_node or world_size % (cfg.tp * cfg.pp):
        return  # no hpZ; or a shape the parallel checks refuse
    for members in dp_groups(world_size, cfg.tp, cfg.pp, islands):
        for node in sorted({r // per_node for r in members}):
            hpz_group_size(hpz, members, lambda r: r // per_node, node)


def _zero_across_sections(cfg: Config, zero: ZeroOptions, dp: int) -> ZeroOptions:
    """The rules between `zero` and other sections (`dp`: the DP ranks one engine spans): the
    PaRO group against them, and those that concern the strategy, refusing a named one or
    narrowing what `paro_strategy: auto` may choose (`ZeroOptions.narrowed`)."""
    k = zero.paro_group_size
    if k is not None and dp % k:
        raise ConfigError(f"zero.paro_group_size = {k}: expected a positive divisor of the data-parallel size {dp}")
    if (cfg.model.lora_rank or cfg.training.trainable) and trainable_fraction(cfg.model, cfg.training.trainable) < 1:
        zpp, persistence = zero.zeropp, zero.stage3_param_persistence_threshold
        zero = zero.narrowed(lambda s: frozen_refusal(s, zpp.qwz, zpp.hpz, persistence))
    if cfg.pp > 1 and cfg.model.tie_embeddings:
        zero = zero.narrowed(tied_split_refusal)
    return zero


def _resolve_batch(t: TrainingOptions, dp: int) -> TrainingOptions:
    """The training section with the global batch size set (given, micro x accumulation x dp,
    or one micro-batch per DP rank), refused where those disagree (each value is > 0: the
    section checked that when built)."""
    per_step = t.micro_batch_size * dp
    total = per_step if t.global_batch_size is None else t.global_batch_size
    if t.gradient_accumulation_steps is not None:
        total = per_step * t.gradient_accumulation_steps
        if t.global_batch_size is not None and t.global_batch_size != total:
            raise ConfigError(
                f"training.global_batch_size = {t.global_batch_size} disagrees with "
                f"micro_batch_size {t.micro_batch_size} x gradient_accumulation_steps "
                f"{t.gradient_accumulation_steps} x data-parallel size {dp} = {total}"
            )
    if total % per_step:
        raise ConfigError(
            f"training.global_batch_size = {total} is not divisible by "
            f"micro_batch_size {t.micro_batch_size} x data-parallel size {dp} = {per_step}"
        )
    return dataclasses.replace(t, global_batch_size=total)


def resolve_outer(cfg: Config, world_size: int, ranks_per_node: int | None) -> OuterOptions | None:
    """The `outer` options (None: two-level training off), with the rules that span sections:
    islands of whole nodes over this world (`ranks_per_node`: the launcher's, unless the config
    sets it), a first outer sync before the run's end (counted from `outer.start_iter`), and
    the combinations not built yet. The synchronous phase before `outer.start_iter` needs no
    rule of its own: its engine spans the islands' DP ranks together, so a PaRO group dividing
    an island's divides it, and on each node it holds the island's ranks (hpZ's rule).
    `zero.paro_strategy: auto` is allowed: the island's strategy is chosen once the ranks can
    probe their links (`planner.auto.auto_strategy` with the outer options), and with
    `outer.start_iter` the synchronous phase's as a synchronous job's."""
    if not cfg.outer.enabled:
        return None
    options = cfg.outer
    layers = cfg.model.num_layers // cfg.pp
    if options.fragments > layers:
        raise ConfigError(
            f"outer.fragments = {options.fragments}: a pipeline stage holds {layers} layer(s) here; "
            f"fragments are runs of parameter tensors, use at most one per layer ({layers})"
        )
    per_node = cfg.parallel.ranks_per_node or ranks_per_node or world_size
    try:
        if not options.elastic:  # an elastic island is its job's whole world
            island_layout(world_size, cfg.tp, cfg.pp, per_node, options.island_nodes)
    except TopologyError as err:
        raise ConfigError(f"outer.algorithm diloco on {world_size} ranks, {per_node} per node: {err}") from None
    every = options.optimizer_state_every
    if every not in (0, OuterOptions.optimizer_state_every) and not cfg.optimizer.state_names:
        raise ConfigError(
            f"outer.optimizer_state_every = {every}: the inner optimizer ({cfg.optimizer.name}, momentum 0) "
            f"keeps no state to average across islands; drop the setting"
        )
    iters, start = cfg.training.train_iters, options.start_iter
    if start >= iters:
        raise ConfigError(
            f"outer.start_iter = {start} with training.train_iters = {iters}: the islands would start after "
            f"the run's last step, so it would train synchronously throughout: give outer.start_iter below "
            f"{iters} (--outer-start-iter; 0: islands from the start), or outer.algorithm none"
        )
    first_landing = first_sync_after(start, options.sync_every, options.overlap_steps)
    if first_landing > iters and not start:
        raise ConfigError(
            f"outer.sync_every = {options.sync_every} with training.train_iters = {iters}: "
            f"the first outer sync would land after step {first_landing}, past the run's end, so the islands "
            f"never meet and its checkpoints and exports hold the parameters it started from: give "
            f"outer.sync_every <= {iters - options.overlap_steps} (--outer-sync-every)"
        )
    if first_landing > iters:
        raise ConfigError(
            f"outer.start_iter = {start}, outer.sync_every = {options.sync_every} with training.train_iters = "
            f"{iters}: the islands start at {start} and their first outer sync (at the multiples of H, plus "
            f"outer.overlap_steps {options.overlap_steps}) would land at {first_landing}, past the run's end, "
            f"so they never meet: give an earlier --outer-start-iter or a smaller --outer-sync-every"
        )
    return options
