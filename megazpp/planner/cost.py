"""Memory and step time of one strategy (+ ZeRO++ switches) on one pipeline stage.

Why the terms are split into phases: the overlap model needs to know WHEN bytes move
(forward fetch, backward fetch of the groups not kept from forward, per-micro-batch
reduction, step boundary, refresh), while the byte totals must stay exactly
`traffic.step_bytes`. The phases are `traffic.step_parts`, the very terms `step_bytes` sums,
timed here; tests/test_planner_costs.py asserts that they add up to it for every strategy and
combination.

Overlap model, per micro-batch of forward time t_f and backward time t_b (compute only):

* forward: parameter fetches (p sharded) are prefetched one unit ahead, so they hide behind
  the forward compute; exposed = max(fetch - t_f, one unit's fetch) (the first unit waits);
* backward: re-fetches (none for groups kept from forward, none for a recompute) and the
  per-micro-batch gradient
  reduction share the link and hide behind backward compute; exposed = max(fetch + reduce -
  t_b, one bucket's share) (the last bucket's reduction starts when backward ends);
* last micro-batch: the step-boundary reduction also starts in its backward (the engine starts
  a bucket's boundary reduction as soon as its last gradient is in), same rule;
* `Cluster.overlap = False` (hosts whose cores both compute and move bytes): the cores' share
  of a collective (`timing.host_time`: the call, and its bytes at the host's own copy rate)
  hides nothing; only the rest, waiting on a slower link, hides behind compute;
* after backward nothing hides: parameter refresh, norm all-reduce, the AdamW update (memory
  bound: 28 bytes of fp32 state read/written + the model-dtype copy per os element).
Tensor-parallel all-reduces (4 per layer and micro-batch, 6 with recomputation) and pipeline
sends are on the critical path; 1F1B adds (P - 1) micro-batch slots of bubble.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megazpp.errors import ConfigError
from megazpp.model.flops import training_flops_per_token
from megazpp.parallel import wire
from megazpp.parallel.wire import GroupShape
from megazpp.planner.activations import stage_activation_bytes
from megazpp.planner.cluster import Cluster
from megazpp.planner.shape import StageShape
from megazpp.planner.timing import collective_time, group_all_reduce_time, host_time, link_time
from megazpp.planner.workload import Workload
from megazpp.zero import memory, sequences, traffic
from megazpp.zero.layout import padded_numel, tensor_layout
from megazpp.zero.strategy import Level, Strategy, level_div
from megazpp.zero.zeropp import ZeroPP

ADAM_TRAFFIC_FP32 = 28  # read master, grad, exp_avg, exp_avg_sq; write master, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Layout:
    """The representative rank (global rank 0) and its groups; every rank is alike by symmetry."""

    dp_size: int
    group_size: int
    shapes: sequences.DPShapes
    hier: sequences.Hierarchy
    extra_norm_groups: tuple[GroupShape, ...]
    tp_group: GroupShape
    pp_neighbor_inter: bool


def dp_ranks_on_node(workload: Workload, cluster: Cluster) -> int:
    """DP ranks of global rank 0's DP group that share its node (the engine's default k)."""
    d = workload.dp(cluster)
    return sum(1 for j in range(d) if (workload.tp * j) // cluster.gpus_per_node == 0)


def layout(workload: Workload, cluster: Cluster, hpz: int = 1) -> Layout:
    d = workload.dp(cluster)
    k = workload.paro_group_size or dp_ranks_on_node(workload, cluster)
    if k < 1 or d % k:
        raise ConfigError(f"paro_group_size = {k}: expected a positive divisor of the data-parallel size {d}")
    dp_ranks = [workload.tp * j for j in range(d)]
    shapes = sequences.dp_shapes(dp_ranks, k, 0, cluster.gpus_per_node, hpz, cluster.backend)
    rpn = cluster.gpus_per_node
    tp_group = GroupShape.of(list(range(workload.tp)), 0, rpn, cluster.backend)
    pp_ranks = [workload.tp * d * s for s in range(workload.pp)]
    extra = tuple(
        g
        for g, size in (
            (tp_group, workload.tp),
            (GroupShape.of(pp_ranks, 0, rpn, cluster.backend), workload.pp),
        )
        if size > 1
    )
    return Layout(
        d,
        k,
        shapes,
        traffic.choose_hierarchy(shapes, workload.hierarchical),
        extra,
        tp_group,
        workload.pp > 1 and pp_ranks[1] // rpn != 0,
    )


@dataclass(frozen=True)
class Phase:
    """One communication phase of a step: bytes and seconds per occurrence, occurrences per step."""

    intra: int = 0
    inter: int = 0
    seconds: float = 0.0
    calls: int = 0
    times: int = 1
    host: float = 0.0  # of `seconds`, the part the host's cores are busy (`timing.host_time`)

    def __add__(self, other: Phase) -> Phase:
        return Phase(
            self.intra + other.intra,
            self.inter + other.inter,
            self.seconds + other.seconds,
            self.calls + other.calls,
            self.times,
            self.host + other.host,
        )


def phases(
    s: Strategy,
    padded: list[int],
    lay: Layout,
    zpp: ZeroPP,
    workload: Workload,
    micro_batches: int,
    cluster: Cluster,
    reused: tuple[bool, ...] = (),
    persistent: int = 0,
) -> dict[str, Phase]:
    """`traffic.step_parts` timed: one Phase per entry of `traffic.STEP_PHASES`.
    `reused`: per fetch group, kept gathered from forward to backward (`traffic.reuse_mask`);
    `persistent`: the last buckets of `padded` are kept whole (never fetched)."""
    parts = traffic.step_parts(
        s,
        padded,
        lay.shapes,
        lay.hier,
        micro_batches=micro_batches,
        param_bytes=workload.param_bytes,
        accum_bytes=workload.accum_bytes,
        zeropp=zpp,
        reused=reused,
        persistent=persistent,
    )
    out = {}
    for name, part in parts.items():
        total = Phase(times=part.times)
        for n in part.numels:
            for c in part.sequence:
                intra, inter, secs = collective_time(c, n, part.elem, lay.shapes, cluster)
                total = total + Phase(
                    intra,
                    inter,
                    secs,
                    1 if getattr(lay.shapes, c.group).size > 1 else 0,
                    host=host_time(c, intra, inter, secs, lay.shapes, cluster),
                )
        out[name] = total
    return out


def optimizer_time(os_elements: int, param_bytes: int, cluster: Cluster) -> float:
    """The AdamW update of this rank's optimizer shard: measured rate, else memory bound."""
    if cluster.optimizer_rate is not None:
        return os_elements / cluster.optimizer_rate
    return os_elements * (ADAM_TRAFFIC_FP32 + param_bytes) / cluster.memory_bw


def norm_phase(s: Strategy, lay: Layout, cluster: Cluster) -> Phase:
    """The fp32 squared-norm all-reduce over the os owners and the TP / PP groups."""
    total = Phase()
    for g in traffic.norm_shapes(s, lay.shapes, lay.extra_norm_groups):
        if g.size > 1:
            total = total + Phase(*wire.all_reduce_bytes(4, g), group_all_reduce_time(4, g, cluster), 1)
    return total


@dataclass
class StagePrediction:
    """Everything predicted for one rank of one pipeline stage."""

    stage: int
    state: memory.StateBytes
    frozen_bytes: int
    activation_bytes: float
    transient_bytes: int
    step_bytes: tuple[int, int]  # (intra, inter) per step: traffic.step_bytes (+ frozen fetches if sharded)
    compute_s: float
    calls: int  # DP collective calls per step (each pays a latency)
    exposed: dict[str, float] = field(default_factory=dict)

    @property
    def memory_bytes(self) -> float:
        return self.state.total + self.frozen_bytes + self.activation_bytes + self.transient_bytes

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s


def reused_groups(s: Strategy, workload: Workload, padded: list[int], persistent: int = 0) -> tuple[bool, ...]:
    """Per fetch group (the buckets of `padded` before the last `persistent`): kept gathered
    from forward to backward, as the engine decides it."""
    if s.params == Level.N:
        return ()
    return traffic.reuse_mask(
        padded[: len(padded) - persistent], workload.max_live_parameters, workload.max_reuse_distance
    )


def _sharded_frozen(
    s: Strategy,
    zpp: ZeroPP,
    stage: StageShape,
    workload: Workload,
    lay: Layout,
    padded: list[int],
    micro_batches: int,
    cluster: Cluster,
) -> tuple[int, dict[str, Phase], int]:
    """Frozen weights of each fetch group sharded at p and gathered with it (forward, backward
    unless kept), never reduced or updated, as the engine holds them (`zero/frozen.py`; the PaRO
    paper's PEFT accounting). Returns (frozen bytes held, the extra fetch phases, the largest
    gathered unit)."""
    pb = workload.param_bytes
    fpadded = [padded_numel(n, lay.dp_size, zpp.alignment()) for n in stage.frozen_groups]
    held = memory.state_bytes(s, fpadded, lay.dp_size, lay.group_size, pb, workload.accum_bytes).params
    held += (stage.frozen - sum(stage.frozen_groups)) * pb
    if zpp.hpz > 1:
        held += sum(n // zpp.hpz * pb for n in fpadded)
    together = [p + f for p, f in zip(padded, fpadded)]  # a group is kept or not with its frozen part
    ph = phases(s, fpadded, lay, zpp, workload, micro_batches, cluster, reused_groups(s, workload, together))
    fetched = {name: ph[name] for name in ("fetch_forward", "fetch_forward_once", "fetch_backward")}
    return held, fetched, max(p + f for p, f in zip(padded, fpadded))


def fastest_hierarchy(
    s: Strategy,
    zpp: ZeroPP,
    padded: list[int],
    lay: Layout,
    workload: Workload,
    cluster: Cluster,
    reused: tuple[bool, ...],
    persistent: int = 0,
) -> sequences.Hierarchy:
    """`zero.hierarchical: auto` by predicted time: per kind of G-level collective (the fields
    of `sequences.Hierarchy`: gather, reduce, all-reduce), two stages where the step's
    collectives of that kind take less time in two stages than in one over all DP ranks.

    Why time, not bytes: two stages carry 1/k of the inter-node bytes but make twice the calls;
    on a slow link the bytes win, on a fast one (or on CPU ranks, where a call costs
    milliseconds of host time whatever its size: `Cluster.collective_times`) the calls do.
    The kinds are decided one by one: the others' collectives are the same in both candidates,
    so the difference in step time is that kind's alone.
    """
    if lay.group_size in (1, lay.dp_size):
        return sequences.Hierarchy()
    return sequences.Hierarchy(
        **{
            kind: two < flat
            for kind, (flat, two) in hierarchy_seconds(
                s, zpp, padded, lay, workload, cluster, reused, persistent
            ).items()
        }
    )


def hierarchy_seconds(
    s: Strategy,
    zpp: ZeroPP,
    padded: list[int],
    lay: Layout,
    workload: Workload,
    cluster: Cluster,
    reused: tuple[bool, ...],
    persistent: int = 0,
) -> dict[str, tuple[float, float]]:
    """Per field of `sequences.Hierarchy`: the step's predicted collective seconds with that kind
    in one stage and in two (the other kinds in one stage): what `fastest_hierarchy` compares."""
    a = workload.micro_batches(cluster)

    def seconds(hier: sequences.Hierarchy) -> float:
        ph = phases(s, padded, dataclasses.replace(lay, hier=hier), zpp, workload, a, cluster, reused, persistent)
        return sum(p.seconds * p.times for p in ph.values())

    flat = seconds(sequences.Hierarchy())
    return {
        f.name: (flat, seconds(sequences.Hierarchy(**{f.name: True}))) for f in dataclasses.fields(sequences.Hierarchy)
    }


def stage_padded(s: Strategy, zpp: ZeroPP, stage: StageShape, lay: Layout) -> list[tuple[int, list[tuple[int, int]]]]:
    """Per fetch group (p sharded) or gradient bucket of `stage`: its padded size and tensor ranges."""
    return [tensor_layout(t, lay.dp_size, zpp.alignment()) for t in stage.group_tensors(s)]


def predict_stage(
    s: Strategy, zpp: ZeroPP, stage: StageShape, workload: Workload, cluster: Cluster, lay: Layout
) -> StagePrediction:
    """With `zero.hierarchical: auto`, under the hierarchy `fastest_hierarchy` picks for this
    stage, as the engine runs it (the builder asks the same function)."""
    a = workload.micro_batches(cluster)
    pb, ab = workload.param_bytes, workload.accum_bytes
    laid = stage_padded(s, zpp, stage, lay)
    padded = [n for n, _ in laid]
    persistent = stage.persistent if s.params != Level.N else 0
    reused = reused_groups(s, workload, padded, persistent)
    if workload.hierarchical == "auto":
        lay = dataclasses.replace(
            lay, hier=fastest_hierarchy(s, zpp, padded, lay, workload, cluster, reused, persistent)
        )
    plain = memory.state_bytes(s, padded, lay.dp_size, lay.group_size, pb, ab, persistent, workload.optimizer_states)
    state = memory.StateBytes(
        plain.params,
        plain.grads,
        plain.optimizer,
        memory.zeropp_state_bytes(padded, lay.shapes, lay.hier, zpp, pb, s, persistent),
    )
    step = traffic.step_bytes(
        s,
        padded,
        lay.shapes,
        lay.hier,
        micro_batches=a,
        param_bytes=pb,
        accum_bytes=ab,
        extra_norm_groups=lay.extra_norm_groups,
        zeropp=zpp,
        reused=reused,
        exact_ranges=[r for _, r in laid],
        persistent=persistent,
    )
    cfg = workload.model
    activations = stage_activation_bytes(
        cfg,
        micro_batch=workload.batches()[0],
        micro_batches=a,
        tp=workload.tp,
        pp=workload.pp,
        stage=stage.stage,
        layers=stage.layers,
        sequence_parallel=workload.sequence_parallel,
        flash_attention=workload.flash_attention,
        checkpointing=workload.activation_checkpointing,
    )
    biggest = max(padded, default=0)
    kept = sum(n for n, again in zip(padded, reused) if again) * pb  # gathered from forward into backward
    transient = (2 * biggest * pb + kept if s.params != Level.N else 0) + (
        2 * biggest * pb if s.grads != Level.N else 0
    )

    tokens = workload.batches()[0] * cfg.seq_length
    forward_flops = training_flops_per_token(cfg) / 3 * tokens / (workload.tp * workload.pp)
    t_f = forward_flops / cluster.flops
    t_b = forward_flops * (1 + workload.trainable_fraction) / cluster.flops
    if workload.activation_checkpointing:
        t_b += t_f
    g_elems = sum(padded) // level_div(s.grads, lay.dp_size, lay.group_size)
    t_accumulate = g_elems * (pb + 2 * ab) / cluster.memory_bw
    compute = (a + workload.pp - 1) * (t_f + t_b) + a * t_accumulate

    ph = phases(s, padded, lay, zpp, workload, a, cluster, reused, persistent)
    frozen_bytes = stage.frozen * pb
    if s.params != Level.N and stage.frozen_groups:
        frozen_bytes, fetched, biggest = _sharded_frozen(s, zpp, stage, workload, lay, padded, a, cluster)
        for name, extra in fetched.items():
            ph[name] = ph[name] + extra
            step = (step[0] + extra.intra * extra.times, step[1] + extra.inter * extra.times)
        transient = 2 * biggest * pb + kept + (2 * biggest * pb if s.grads != Level.N else 0)
    n = max(1, len(padded))
    backward = ph["fetch_backward"] + ph["micro_reduce"]
    last = backward + ph["boundary"]

    def hidden(p: Phase, compute_s: float) -> float:
        """Exposed seconds of phase `p` running alongside `compute_s` of compute."""
        if cluster.overlap:
            return max(p.seconds - compute_s, p.seconds / n)
        return p.host + max(p.seconds - p.host - compute_s, 0.0)

    exposed = {
        "fetch_forward": a * hidden(ph["fetch_forward"], t_f) + hidden(ph["fetch_forward_once"], t_f),
        "backward_comm": (a - 1) * hidden(backward, t_b) + hidden(last, t_b),
        "refresh": ph["refresh"].seconds + ph["refresh_persistent"].seconds,
        "norm": norm_phase(s, lay, cluster).seconds,
        "optimizer": optimizer_time(
            sum(padded) // level_div(s.optimizer_state, lay.dp_size, lay.group_size), pb, cluster
        ),
    }
    act = tokens * cfg.hidden_size * pb / (workload.tp if workload.sequence_parallel else 1)
    if workload.tp > 1:
        per_layer = (6 if workload.activation_checkpointing else 4) * group_all_reduce_time(
            tokens * cfg.hidden_size * pb, lay.tp_group, cluster
        )
        exposed["tensor_parallel"] = a * stage.layers * per_layer
    if workload.pp > 1:
        hop = link_time(0, act, cluster) if lay.pp_neighbor_inter else link_time(act, 0, cluster)
        exposed["pipeline_p2p"] = 2 * a * hop
    calls = sum(p.calls * p.times for p in ph.values())
    return StagePrediction(stage.stage, state, frozen_bytes, activations, transient, step, compute, calls, exposed)
