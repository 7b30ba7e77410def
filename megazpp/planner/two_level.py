"""Two-level options: synchronous ZeRO inside islands of whole nodes, DiLoCo across them
(`megazpp.outer`, docs/arch/outer.md), priced beside the synchronous options.

Why a separate list: an outer optimizer changes the optimisation (the islands drift apart for
H inner steps, then an outer Nesterov step on their mean pseudo-gradient), so a two-level row
is not loss-equivalent to a synchronous one; it is a different trade of quality for the slow
link, and the planner says so wherever it shows one.

What a row costs, per inner step, on the slowest pipeline stage:

* the inner step: the island's own synchronous prediction (`plan.plan` on a cluster of
  `island_nodes` nodes, each island reading 1 / islands of the global batch, so each rank keeps
  its micro-batches), over the island's fast links;
* the outer syncs: every fragment of the rank's os shard (F runs of its parameter tensors, the
  runtime's rule) synced once per H inner steps, the bytes of `megazpp.outer.traffic` at the
  rank's share of the node's link, 2 calls of (I - 1) latency steps each; after each sync the
  island re-publishes its parameters (the inner step's refresh phases once more);
* the inner optimizer's state averaged across islands (`outer.optimizer_state_every` k: every
  k-th sync of a fragment), each of its tensors (AdamW 2, SGD 1) an exchange like the
  fragment's in `outer.traffic.moment_wire`, 1 / k of it per sync; blocking at the sync (not
  overlapped), so exposed whatever tau;
* overlap (`overlap_steps` tau >= 1, Streaming DiLoCo): a fragment's sync runs while tau inner
  steps compute, on the link time the inner step leaves free, so what is exposed per step is
  max(sum_f max(0, t_f - tau free) / H, sum_f t_f / H - free): a fragment longer than tau
  steps waits, and the link cannot carry more than it has time for; where the cores move the
  bytes (`Cluster.overlap` false: CPU ranks) their share of t_f (the calls, the bytes at the
  host's copy rate) is exposed whatever tau; without overlap every sync blocks its step
  (sum_f t_f / H);
* memory: the outer state (fp32 snapshot and momentum, sharded like the optimizer state:
  `zero.memory.outer_state_bytes`; int4's error buffers, `outer.traffic.error_buffer_bytes`)
  and the peak one fragment's sync adds (`outer.traffic.sync_peak_bytes`, or a moment's
  averaging, `moment_peak_bytes`, when larger), on top of the island's: what
  `DiLoCoEngine.expected_bytes` and `expected_sync_peak_bytes` count.

A row prices a step of the islands' phase: with `outer.start_iter` S the first S steps are the
synchronous job's (the synchronous table's row of the run's strategy), so a run's mean step is
(S x that + (T - S) x the row's) / T; the rows themselves and the choice among them do not
depend on S (only which H can still sync before the run ends does).

Recommendation (`recommend`): among the rows that fit and whose exposed outer time is at most
`LINK_BUDGET` of the inner step, the smallest H (the closest to synchronous training: DiLoCo's
quality falls as H grows), then the least compression, no overlap before overlap (its merge is
one more change to the optimisation), the fewest fragments, the fastest; if none stays within
the budget, the fastest row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from megazpp.outer import traffic as outer_traffic
from megazpp.outer.fragments import first_sync_after
from megazpp.outer.settings import QUANTIZE, OuterOptions
from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.cost import StagePrediction, layout, stage_padded
from megazpp.planner.plan import TIE, Plan, Prediction, options, pick, plan, predict
from megazpp.planner.shape import StageShape
from megazpp.planner.workload import Workload
from megazpp.zero import memory
from megazpp.zero.strategy import Strategy, level_div
from megazpp.zero.zeropp import ZeroPP

SYNC_EVERY = (5, 10, 20, 50, 100, 200, 500)  # H: DiLoCo's range (it reports H = 500)
FRAGMENTS = (1, 2, 4, 8, 16)
OVERLAP_STEPS = (0, 1)
LINK_BUDGET = 0.10  # of the inner step: the target, the slow link costs at most 10 %


@dataclass(frozen=True)
class OuterChoice:
    """One two-level setting: the `outer:` config keys it stands for."""

    island_nodes: int
    sync_every: int
    fragments: int
    overlap_steps: int
    quantize: str
    # the user's (the planner prices it, never picks it; its own rows keep the state per
    # island, and their flags say so): the inner optimizer's `state_tensors` tensors averaged
    # across islands every `state_every`-th sync of a fragment (0: never)
    state_every: int = 0
    state_tensors: int = 0

    @classmethod
    def of(cls, options: OuterOptions, state_tensors: int) -> OuterChoice:
        """The setting a run's resolved `outer` section stands for, its inner optimizer keeping
        `state_tensors` state tensors per parameter (`Workload.optimizer_states`)."""
        o = options
        every = o.optimizer_state_every if state_tensors else 0
        return cls(o.island_nodes, o.sync_every, o.fragments, o.overlap_steps, o.quantize, every, state_tensors)

    @property
    def moment_every(self) -> tuple[int, ...]:
        """The period of each state tensor averaged (`outer.traffic.per_step`)."""
        return (self.state_every,) * self.state_tensors if self.state_every else ()

    @property
    def name(self) -> str:
        moments = f" state every {self.state_every}" if self.moment_every else ""
        return (
            f"DiLoCo H={self.sync_every} {self.quantize} F={self.fragments} tau={self.overlap_steps}{moments}, "
            f"islands of {self.island_nodes} node{'s' if self.island_nodes > 1 else ''}"
        )

    def flags(self) -> str:
        return (
            f"--outer-algorithm diloco --outer-island-nodes {self.island_nodes} --outer-sync-every "
            f"{self.sync_every} --outer-fragments {self.fragments} --outer-overlap-steps "
            f"{self.overlap_steps} --outer-quantize {self.quantize} --outer-optimizer-state-every "
            f"{self.state_every if self.moment_every else 0}"
        )


@dataclass(frozen=True)
class OuterStage:
    """The outer cost of one pipeline stage's ranks."""

    traffic: outer_traffic.OuterTraffic  # per rank, per inner step (mean) and the peak step
    sync_s: tuple[float, ...]  # link seconds of each fragment's sync
    republish_s: float  # the island's parameter refresh after a sync
    exposed_s: float  # outer seconds per inner step not hidden behind it
    state_bytes: int  # the outer state and the sync's peak temporaries


@dataclass
class TwoLevelPrediction:
    outer: OuterChoice
    inner: Prediction  # the island's synchronous prediction
    stages: list[OuterStage]
    memory_limit: float

    @property
    def name(self) -> str:
        return f"{self.inner.name} + {self.outer.name}"

    @property
    def step_s(self) -> float:
        return max(i.step_s + o.exposed_s for i, o in zip(self.inner.stages, self.stages))

    @property
    def inner_step_s(self) -> float:
        return self.inner.step_s

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.inner_step_s

    @property
    def memory_bytes(self) -> float:
        return max(i.memory_bytes + o.state_bytes for i, o in zip(self.inner.stages, self.stages))

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit

    @property
    def mean_inter_bytes(self) -> float:
        """Outer inter-node bytes per rank per inner step (the busiest stage)."""
        return max(o.traffic.mean_inter for o in self.stages)

    @property
    def peak_inter_bytes(self) -> int:
        return max(o.traffic.peak_inter for o in self.stages)

    @property
    def within_budget(self) -> bool:
        return self.exposed_s <= LINK_BUDGET * self.inner_step_s


def fragment_numels(tensor_numels: list[int], fragments: int) -> list[int]:
    """Elements in each of `fragments` runs of the stage's parameter tensors (in bucket order),
    cut as the runtime cuts them (`outer.traffic.fragment_runs`)."""
    runs = outer_traffic.fragment_runs(len(tensor_numels), fragments)
    return [sum(tensor_numels[run.start : run.stop]) for run in runs]


def island_job(
    workload: Workload,
    cluster: Cluster,
    island_nodes: int,
    island_times: dict[str, tuple[tuple[float, float], ...]] | None = None,
) -> tuple[Workload, Cluster, int]:
    """One island's workload and cluster, and the number of islands: each island reads
    1 / islands of every global batch. The whole job's probed collective times
    (`Cluster.collective_times`) are left out: they were measured on its groups, not the
    island's; `island_times`, probed on the island's own groups (`probe.probe_host` on a
    `Topology.island_view`, as `paro_strategy: auto` and tools/bench_netlab_check.py do), price
    the island's collectives instead; without them its links and latencies do."""
    islands = cluster.nodes // island_nodes
    return (
        dataclasses.replace(workload, global_batch=workload.batches()[1] // islands),
        dataclasses.replace(cluster, nodes=island_nodes, collective_times=island_times),
        islands,
    )


def outer_stage(
    choice: OuterChoice,
    inner: StagePrediction,
    padded: list[int],
    tensors: list[int],
    strategy: Strategy,
    dp_size: int,
    group_size: int,
    islands: int,
    cluster: Cluster,
) -> OuterStage:
    """The outer cost of one stage's ranks under `choice`; `padded`: the stage's buckets (fetch
    groups when p is sharded) as the island's engine pads them; `tensors`: the elements of its
    parameter tensors in bucket order (a rank's fragment is its os shard's share of a run)."""
    div = level_div(strategy.optimizer_state, dp_size, group_size)
    frags = [n // div for n in fragment_numels(tensors, choice.fragments)]
    moved = outer_traffic.per_step(frags, islands, choice.quantize, choice.sync_every, moment_every=choice.moment_every)
    calls_s = outer_traffic.sync_calls(islands) * (islands - 1) * cluster.inter_latency
    # each fragment's moments, averaged at 1 / k of its syncs, blocking
    moments_s = sum(
        (calls_s + outer_traffic.moment_sync_bytes(n, islands, choice.quantize)[1] / cluster.inter_bw_per_rank) / k
        for n in frags
        for k in choice.moment_every
    )
    sync_s = tuple(
        calls_s + outer_traffic.sync_bytes(n, islands, choice.quantize)[1] / cluster.inter_bw_per_rank for n in frags
    )
    republish = inner.exposed.get("refresh", 0.0)
    h = choice.sync_every
    if choice.overlap_steps:
        # where the cores move the bytes (`Cluster.overlap` false), their share (the calls, the
        # bytes at the host's copy rate) hides nothing, as in the synchronous model
        host = [
            0.0
            if cluster.overlap
            else min(t, calls_s + outer_traffic.sync_bytes(n, islands, choice.quantize)[1] / cluster.intra_bw)
            for t, n in zip(sync_s, frags)
        ]
        wait = [t - c for t, c in zip(sync_s, host)]
        free = max(0.0, inner.step_s - inner.step_bytes[1] / cluster.inter_bw_per_rank)
        link = sum(host) / h + max(
            sum(max(0.0, w - choice.overlap_steps * free) for w in wait) / h, sum(wait) / h - free
        )
    else:
        link = sum(sync_s) / h
    link += moments_s / h
    # the snapshot and momentum, int4's error buffers, and the sync's peak (one fragment in
    # flight: the planner's overlap is at most one step), as DiLoCoEngine.expected_bytes and
    # expected_sync_peak_bytes count them
    state = (
        memory.outer_state_bytes(strategy, padded, dp_size, group_size, fp32_copies=2)
        + (sum(outer_traffic.error_buffer_bytes(n, islands) for n in frags) if choice.quantize == "int4" else 0)
        + max(
            max(outer_traffic.sync_peak_bytes(n, islands, choice.quantize) for n in frags),
            max(outer_traffic.moment_peak_bytes(n, islands, choice.quantize) for n in frags)
            if choice.moment_every
            else 0,
        )
    )
    return OuterStage(moved, sync_s, republish, link + len(frags) * republish / h, state)


def island_sizes(cluster: Cluster) -> list[int]:
    """Nodes per island that leave at least two islands of whole nodes."""
    return [n for n in range(1, cluster.nodes // 2 + 1) if cluster.nodes % n == 0]


def predict_two_level(
    choice: OuterChoice, inner: Prediction, shapes: list[StageShape], workload: Workload, cluster: Cluster
) -> TwoLevelPrediction:
    """`choice` on top of the island's synchronous prediction `inner` (`island_job`'s workload
    and cluster are derived here from the whole job's)."""
    job, island, islands = island_job(workload, cluster, choice.island_nodes)
    opt = inner.option
    lay = layout(job, island, opt.zeropp.hpz)
    stages = [
        outer_stage(
            choice,
            pred,
            [n for n, _ in stage_padded(opt.strategy, opt.zeropp, st, lay)],
            [n for group in st.group_tensors(opt.strategy) for n, _ in group],
            opt.strategy,
            lay.dp_size,
            lay.group_size,
            islands,
            cluster,
        )
        for st, pred in zip(shapes, inner.stages)
    ]
    return TwoLevelPrediction(choice, inner, stages, inner.memory_limit)


@dataclass
class TwoLevelPlan:
    rows: list[TwoLevelPrediction]  # the recommendation first, then by step time
    choice: TwoLevelPrediction | None
    islands_plans: dict[int, Plan]  # per island size: the island's synchronous plan


@dataclass
class IslandPlan:
    """The island's options under one outer setting (`paro_strategy: auto` with islands)."""

    outer: OuterChoice
    rows: list[TwoLevelPrediction]  # fitting first, then fastest first, then least memory
    choice: TwoLevelPrediction | None
    runner_up: TwoLevelPrediction | None
    reason: str


def plan_island(
    shapes: list[StageShape],
    workload: Workload,
    cluster: Cluster,
    outer: OuterChoice,
    *,
    fixed_zeropp: ZeroPP | None = None,
    allowed: Callable[[Strategy], bool] = lambda s: True,
    island_times: dict[str, tuple[tuple[float, float], ...]] | None = None,
    tie: float = TIE,
) -> IslandPlan:
    """Every option `plan.options` lists for one island's job (the run's ZeRO++ switches,
    `allowed` strategies), each priced as a two-level row under `outer`: its inner step over
    the island's links (`island_times`: see `island_job`), plus its outer syncs amortised over
    H, its memory with the outer state (whose size and sync bytes follow the option's os
    level); sorted and recommended by the synchronous plan's rule (`plan.pick`). `workload`
    and `cluster` are the whole job's."""
    job, island, _ = island_job(workload, cluster, outer.island_nodes, island_times)
    rows = sorted(
        (
            predict_two_level(outer, predict(o, shapes, job, island), shapes, workload, cluster)
            for o in options(job, island, fixed_zeropp, allowed)
        ),
        key=lambda p: (not p.fits, p.step_s, p.memory_bytes, p.inner.name),
    )
    choice, runner = pick(rows, tie)
    return IslandPlan(outer, rows, choice, runner, _island_reason(choice, runner, rows))


def _island_reason(
    choice: TwoLevelPrediction | None, runner: TwoLevelPrediction | None, rows: list[TwoLevelPrediction]
) -> str:
    if choice is None:
        least = min(rows, key=lambda p: p.memory_bytes)
        return (
            f"nothing fits under {least.outer.name}: the smallest footprint, {least.inner.name} with its outer "
            f"state, needs {least.memory_bytes / GIB:.1f} GiB of {least.memory_limit / GIB:.1f} GiB usable"
        )
    parts = [
        f"{choice.inner.name} inside each island fits ({choice.memory_bytes / GIB:.2f} GiB of "
        f"{choice.memory_limit / GIB:.2f} GiB usable, outer state included) and is predicted at "
        f"{choice.step_s:.3f} s/step under {choice.outer.name}: inner step {choice.inner_step_s:.3f} s "
        f"+ exposed outer {choice.exposed_s:.3f} s ({choice.mean_inter_bytes / 1e9:.4f} GB outer "
        f"inter-node per rank per inner step)"
    ]
    if runner is not None:
        parts.append(
            f"runner-up {runner.inner.name}: {runner.step_s:.3f} s/step "
            f"({100 * (runner.step_s / choice.step_s - 1):+.1f} %), {runner.memory_bytes / GIB:.2f} GiB"
        )
    return "; ".join(parts)


def _preference(p: TwoLevelPrediction) -> tuple[int, int, int, int, float]:
    o = p.outer
    return (o.sync_every, QUANTIZE.index(o.quantize), o.overlap_steps, o.fragments, p.step_s)


def recommend(rows: list[TwoLevelPrediction]) -> TwoLevelPrediction | None:
    """The module docstring's rule: within the link budget the smallest H and least change to
    the optimisation; else the fastest."""
    fitting = [p for p in rows if p.fits]
    within = [p for p in fitting if p.within_budget]
    if within:
        return min(within, key=_preference)
    return min(fitting, key=lambda p: (p.step_s, p.outer.sync_every), default=None)


def plan_two_level(
    shapes: list[StageShape], workload: Workload, cluster: Cluster, *, fixed_zeropp: ZeroPP | None = None
) -> TwoLevelPlan:
    """Every island size, H, fragment count, overlap and outer quantization on the island's
    fastest fitting synchronous option (the next fastest where the outer state does not fit).
    Fragments are at most H and at most the stage's layers, and the first sync lands within the
    run's `train_iters` (H + tau at most that, or the islands never meet; counted from
    `outer.start_iter` when the islands start later): the runtime's limits (`config.checks`)."""
    rows: list[TwoLevelPrediction] = []
    island_plans: dict[int, Plan] = {}
    for nodes in island_sizes(cluster):
        job, island, islands = island_job(workload, cluster, nodes)
        if workload.batches()[1] % islands:
            continue
        inner_plan = plan(shapes, job, island, fixed_zeropp=fixed_zeropp)
        island_plans[nodes] = inner_plan
        inner_rows = [p for p in inner_plan.rows if p.fits]
        if inner_plan.choice is not None:
            inner_rows.insert(0, inner_plan.choice)
        for h in SYNC_EVERY:
            for q in QUANTIZE:
                for tau in OVERLAP_STEPS:
                    landing = first_sync_after(workload.start_iter, h, tau)
                    if workload.train_iters is not None and landing > workload.train_iters:
                        continue
                    for f in (f for f in FRAGMENTS if f <= h):
                        choice = OuterChoice(nodes, h, f, tau, q)
                        for inner in inner_rows:
                            if any(st.layers < f for st in shapes):  # the runtime's limit (config.checks)
                                break
                            row = predict_two_level(choice, inner, shapes, workload, cluster)
                            if row.fits:
                                rows.append(row)
                                break
    best = recommend(rows)
    rows.sort(key=lambda p: (p is not best, p.step_s))
    return TwoLevelPlan(rows, best, island_plans)


def digest(tp: TwoLevelPlan) -> list[TwoLevelPrediction]:
    """The rows worth printing: the recommendation, then per island size, outer quantization
    and overlap the row `recommend` would take among those alone, fastest first."""
    picked: list[TwoLevelPrediction] = []
    keys = sorted({(p.outer.island_nodes, p.outer.quantize, p.outer.overlap_steps) for p in tp.rows})
    for key in keys:
        row = recommend([p for p in tp.rows if (p.outer.island_nodes, p.outer.quantize, p.outer.overlap_steps) == key])
        if row is not None and row is not tp.choice:
            picked.append(row)
    return ([tp.choice] if tp.choice else []) + sorted(picked, key=lambda p: p.step_s)
