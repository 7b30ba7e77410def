"""The start-up banner: what this run is, in a few console lines, before its first step.

Why: a log read hours later (or a job that dies at step 1) must say what was run: the
model's size, how the ranks are laid out, which data-parallel strategy runs and who chose
it, how much data each split holds, where checkpoints and TensorBoard events go, which
checkpoint the run started from and why, and what the config loader adjusted.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

from megazpp.config.schema import Config
from megazpp.model.flops import parameter_count, parameter_text
from megazpp.model.trainable import trainable_fraction
from megazpp.optim.engine_protocol import Engine
from megazpp.optim.options import OptimizerOptions
from megazpp.outer.diloco import TwoLevelEngine
from megazpp.outer.fragments import first_sync_after
from megazpp.outer.traffic import moment_wire
from megazpp.parallel.topology import Topology
from megazpp.training.startup import Startup
from megazpp.zero.inner_engine import ShardedEngine


def _optimizer(o: OptimizerOptions) -> str:
    return f"sgd (momentum {o.sgd_momentum:g})" if o.name == "sgd" else "adamw"


def _strategy(cfg: Config, engine: Engine) -> str:
    """The strategy, who chose it, the group sizes and hierarchy the engine runs, and ZeRO++ as
    it runs (hpZ lowered to a node's DP ranks, all off on one DP rank) with why it differs from
    what was asked: said here once, not by every rank of the engine."""
    if not isinstance(engine, ShardedEngine):
        return "none: one data-parallel replica (LocalEngine)"
    shards = engine.shard_layout()  # with two-level training, each island's
    two_level = isinstance(engine, TwoLevelEngine)
    strategy = shards.strategy
    z = cfg.zero
    if z.paro_strategy is not None and str(z.paro_strategy).lower() == "auto":
        source = (
            "zero.paro_strategy auto: the planner's choice for each island, priced as the two-level job, reason above"
            if two_level
            else "zero.paro_strategy auto: the planner's choice, reason above"
        )
    elif z.paro_strategy is not None:
        source = f"zero.paro_strategy {z.paro_strategy}"
    elif z.stage:
        source = f"zero.stage {z.stage}"
    else:
        source = "data parallel with no ZeRO stage: plain DDP"
    hier = shards.hier
    two_stage = [
        name for name, on in (("gather", hier.gather), ("reduce", hier.reduce), ("all-reduce", hier.all_reduce)) if on
    ]
    layout = (
        f"dp {shards.dp}, PaRO group {shards.group_size}; G collectives "
        f"{'in two stages (group, then across): ' + ', '.join(two_stage) if two_stage else 'in one stage'}"
    )
    zpp = shards.zeropp
    zeropp = [
        name
        for name, on in (("qwZ", zpp.qwz), (f"hpZ {zpp.hpz}", zpp.hpz > 1), ("qgZ", zpp.qgz), ("LoCo", zpp.loco))
        if on
    ]
    asked = z.zero_quantized_weights or z.zero_quantized_gradients or z.zero_hpz_partition_size > 1 or z.loco
    if asked and not zpp.enabled:
        zeropp_note = "; ZeRO++ off: one data-parallel rank, nothing crosses a link to compress (exact paths)"
    elif z.zero_hpz_partition_size > zpp.hpz > 1:
        zeropp_note = (
            f"; zero_hpz_partition_size {z.zero_hpz_partition_size} lowered to {zpp.hpz}, the "
            "data-parallel ranks of one node (hpZ's secondary copy stays inside a node)"
        )
    elif z.zero_hpz_partition_size > zpp.hpz:
        zeropp_note = (
            f"; zero_hpz_partition_size {z.zero_hpz_partition_size}: hpZ off, a node holds one "
            "data-parallel rank (backward gathers the primary shards)"
        )
    else:
        zeropp_note = ""
    return f"PaRO {strategy} ({source}){' + ' + ', '.join(zeropp) if zeropp else ''}; {layout}{zeropp_note}"


def _trains(cfg: Config) -> str:
    """What trains when not everything does (LoRA adapters, `training.trainable`)."""
    fraction = trainable_fraction(cfg.model, cfg.training.trainable)
    if fraction == 1.0:
        return ""
    what = [f"LoRA rank {cfg.model.lora_rank} adapters"] if cfg.model.lora_rank else []
    what += cfg.training.trainable
    return f"; training {fraction:.2%} of the weights ({', '.join(what)}), the rest frozen"


WIRE = {"none": "fp32 (uncompressed)", "bf16": "bf16"}  # the outer gradients' wire, in words


def _synchronous_phase(cfg: Config, topology: Topology, engine: Engine) -> list[str]:
    """Before `outer.start_iter` the engine is the synchronous one: when the islands start."""
    o = cfg.outer
    if not o.enabled or isinstance(engine, TwoLevelEngine):
        return []
    islands = topology.num_nodes // o.island_nodes
    return [
        f"two-level from iteration {o.start_iter} (outer.start_iter): synchronous over all {topology.dp} DP "
        f"ranks until then (the strategy above), then {islands} islands of {o.island_nodes} node(s), DiLoCo "
        f"every {o.sync_every} inner steps, the first outer sync landing at iteration "
        f"{first_sync_after(o.start_iter, o.sync_every, o.overlap_steps)}; the switch is logged"
    ]


def _state_averaging(engine: TwoLevelEngine) -> str:
    """What becomes of the inner optimizer's state at the syncs, in words."""
    o, state = engine.options, engine.averaged_state
    if not state:
        return "; the inner optimizer's state kept per island"
    return (
        f"; the inner optimizer's {' and '.join(state)} averaged across islands every "
        f"{o.optimizer_state_every} sync(s) (blocking, in {'fp32' if moment_wire(o.quantize) == 'none' else 'bf16'})"
    )


def _two_level(engine: Engine) -> list[str]:
    """The island layout and the outer step, when two-level training is on: every outer setting
    that changes what a sync does, in words (not "none outer gradients")."""
    if not isinstance(engine, TwoLevelEngine):
        return []
    o, island = engine.options, engine.island
    if o.elastic:  # the islands are other jobs, met through the lighthouse (docs/arch/elastic.md)
        return [
            f"two-level, elastic: island {o.island_id}, {island.dp} DP rank(s) (ZeRO inside); DiLoCo every "
            f"{o.sync_every} inner steps with the islands live at each sync (at least {o.min_islands}, "
            f"lighthouse {o.lighthouse}), their pseudo-gradients weighted by the tokens each trained; outer lr "
            f"{o.lr:g}, Nesterov momentum {o.momentum:g}; fp32 outer gradients, the whole model at each sync"
            + _state_averaging(engine)
        ]
    inter = engine.expected_sync_bytes()[1]
    wire = WIRE.get(o.quantize) or f"int4 {'with' if o.error_feedback else 'without'} error feedback"
    if o.fragments == 1:
        what = "the whole model at each sync"
    else:
        what = f"the model in {o.fragments} fragments at staggered steps (streaming; one fragment a sync step)"
    if o.overlap_steps:
        applied = (
            f"each exchange runs while {o.overlap_steps} inner step(s) go on, then is merged keeping "
            f"{o.merge_alpha:g} of the island's own parameters"
        )
    else:
        applied = "each exchange applied at once (no overlap)"
    moments = _state_averaging(engine)
    warmup = f" (reached after {o.warmup_syncs} syncs ramping from plain averaging)" if o.warmup_syncs else ""
    if o.momentum:
        step = f"outer lr {o.lr:g}, Nesterov momentum {o.momentum:g}{warmup}"
    else:
        step = (
            "the islands' mean (plain averaging: outer lr 1, no momentum)"
            if o.lr == 1
            else f"outer lr {o.lr:g}, no momentum"
        )
    return [
        f"two-level: {engine.islands} islands of {o.island_nodes} node(s), {island.dp} DP rank(s) each (ZeRO "
        f"inside an island); DiLoCo every {o.sync_every} inner steps to {step}; {what}; {applied}; outer "
        f"gradients sent as {wire}: {inter / 1e6:.3g} MB inter-node per rank every {o.sync_every} steps{moments}"
        + (f"; synchronous over all ranks before iteration {o.start_iter} (outer.start_iter)" if o.start_iter else "")
    ]


def engine_lines(cfg: Config, engine: Engine) -> list[str]:
    """What the banner says of the data-parallel engine (and the switch, of the islands')."""
    return [f"data-parallel optimizer: {_strategy(cfg, engine)}", *_two_level(engine)]


def banner(
    cfg: Config, topology: Topology, engine: Engine, datasets: Sequence[Sized | None], start: Startup
) -> list[str]:
    m, t, ck = cfg.model, cfg.training, cfg.checkpoint
    precision = "bf16" if cfg.precision.bf16 else "fp16" if cfg.precision.fp16 else "fp32"
    train_ds, valid_ds = datasets
    if train_ds is None:
        raise ValueError("the startup banner needs the training dataset")
    sizes = f"train {len(train_ds)} samples" + (
        f", valid {len(valid_ds)}" if valid_ds is not None else ", no validation"
    )
    saving = (
        f"{ck.save} every {ck.save_interval} steps and at the last"
        if ck.save and ck.save_interval
        else f"{ck.save} at the last step"
        if ck.save
        else "not saved"
    )
    if ck.save and ck.save_adapters_only and start.load.base is not None:
        saving += f", adapters only (frozen base: {start.load.base.describe()})"
    lines = [
        f"model: {m.arch}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
        f"heads, seq {m.seq_length}, vocab {m.vocab_size}: {parameter_text(parameter_count(m))} "
        f"parameters, {precision}{_trains(cfg)}",
        f"layout: world {topology.world_size} = tp {topology.tp} x pp {topology.pp} x dp "
        f"{topology.dp}; {topology.num_nodes} node(s) x {topology.ranks_per_node} ranks",
        *engine_lines(cfg, engine),
        *_synchronous_phase(cfg, topology, engine),
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x dp {topology.dp} "
        f"x {cfg.num_micro_batches(topology.world_size)} accumulation; {t.train_iters} steps, "
        f"warmup {t.lr_warmup_iters}, lr {cfg.optimizer.lr:g} {t.lr_decay_style} to "
        f"{cfg.optimizer.min_lr:g}, {_optimizer(cfg.optimizer)}",
        f"data: {' '.join(cfg.data.data_path)} (split {cfg.data.split}): {sizes}",
        f"checkpoints: {saving}; TensorBoard: {cfg.logging.tensorboard_dir or 'off'}",
        f"start: {start.load.why}",
    ]
    return lines + [f"note: {note}" for note in start.notes]
