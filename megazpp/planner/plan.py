"""Evaluate every applicable strategy / ZeRO++ combination, sort, and recommend one.

Why the near-tie rule: predictions are first-order; when two options are within `tie` (2 %)
of the fastest, the difference is below the model's accuracy, so the one that holds less
memory wins (headroom for a larger micro-batch, fewer surprises from fragmentation), provided
it saves at least 5 % of the usable memory; otherwise the faster one wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.cost import StagePrediction, dp_ranks_on_node, layout, predict_stage
from megazpp.planner.shape import StageShape
from megazpp.planner.workload import Workload
from megazpp.zero.strategy import VALID_STRATEGIES, Level, Strategy
from megazpp.zero.zeropp import ZeroPP, zeropp_refusal

TIE = 0.02
SAME_MEMORY = 0.05  # of the usable memory: smaller savings are not worth a slower option


@dataclass(frozen=True)
class Option:
    strategy: Strategy
    zeropp: ZeroPP = ZeroPP()

    @property
    def name(self) -> str:
        z = self.zeropp
        tags = [t for t, on in (("qwZ", z.qwz), (f"hpZ{z.hpz}", z.hpz > 1), ("qgZ", z.qgz), ("LoCo", z.loco)) if on]
        return "+".join([self.strategy.name] + tags)


def applies(zpp: ZeroPP, s: Strategy) -> bool:
    """Whether each ZeRO++ switch that is on has a collective to act on (the rule `ZeroOptions`
    refuses by, `zeropp.zeropp_refusal`)."""
    return zeropp_refusal(zpp, s) is None


def options(
    workload: Workload,
    cluster: Cluster,
    fixed: ZeroPP | None = None,
    allowed: Callable[[Strategy], bool] = lambda s: True,
) -> list[Option]:
    """All 14 strategies, each with every useful ZeRO++ combination (or only `fixed`).

    qwZ where parameters are gathered (p in {I, G}), qgZ where gradients are reduced per
    micro-batch (g in {I, G}), hpZ where parameters are gathered across nodes (p = G with DP
    spanning nodes) and a node holds at least 2 DP ranks. With one DP rank ZeRO++ has nothing
    to compress (the engine turns it off), so only the plain strategies are listed. `allowed`
    leaves out strategies the run cannot use (the engine refuses them).
    """
    d = workload.dp(cluster)
    strategies = [s for s in VALID_STRATEGIES if allowed(s)]
    if fixed is not None:
        return [Option(s, fixed if d > 1 else ZeroPP()) for s in strategies if applies(fixed, s)]
    on_node = dp_ranks_on_node(workload, cluster)
    hpz = min(workload.hpz_size or on_node, on_node)
    spans_nodes = layout(workload, cluster).shapes.dp.inter_peers > 0
    out = []
    for s in strategies:
        if d == 1:
            out.append(Option(s))
            continue
        for qwz in (False, True) if s.params != Level.N else (False,):
            hpzs = (1, hpz) if s.params == Level.G and spans_nodes and hpz > 1 and d % hpz == 0 else (1,)
            for h in hpzs:
                for qgz in (False, True) if s.grads != Level.N else (False,):
                    out.append(Option(s, ZeroPP(qwz=qwz, hpz=h, qgz=qgz)))
    return out


@dataclass
class Prediction:
    """One option over all pipeline stages: the slowest stage sets the step, the fullest the fit."""

    option: Option
    stages: list[StagePrediction]
    memory_limit: float

    @property
    def name(self) -> str:
        return self.option.name

    @property
    def critical(self) -> StagePrediction:
        return max(self.stages, key=lambda p: p.step_s)

    @property
    def fullest(self) -> StagePrediction:
        return max(self.stages, key=lambda p: p.memory_bytes)

    @property
    def step_s(self) -> float:
        return self.critical.step_s

    @property
    def memory_bytes(self) -> float:
        return self.fullest.memory_bytes

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit


def predict(option: Option, shapes: list[StageShape], workload: Workload, cluster: Cluster) -> Prediction:
    lay = layout(workload, cluster, option.zeropp.hpz)
    stages = [predict_stage(option.strategy, option.zeropp, st, workload, cluster, lay) for st in shapes]
    return Prediction(option, stages, cluster.memory_bytes * cluster.usable_memory_fraction)


@dataclass
class Plan:
    rows: list[Prediction]  # fitting first, then fastest first, then least memory
    choice: Prediction | None
    runner_up: Prediction | None
    reason: str


def _sort_key(p: Prediction) -> tuple[bool, float, float, str]:
    return (not p.fits, p.step_s, p.memory_bytes, p.name)


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _reason(choice: Prediction | None, runner: Prediction | None, rows: list[Prediction], tie: float) -> str:
    if choice is None:
        least = min(rows, key=lambda p: p.memory_bytes)
        m = least.fullest
        shares = {
            "model state": m.state.total,
            "frozen weights": m.frozen_bytes,
            "activations": m.activation_bytes,
            "buffers": m.transient_bytes,
        }
        largest = max(shares, key=lambda k: shares[k])
        remedy = {
            "model state": "raise TP / PP (or add nodes)",
            "frozen weights": "raise TP / PP or shard parameters (p = I or G)",
            "activations": "turn on activation checkpointing, shrink the micro-batch or raise TP "
            "(with sequence parallelism)",
            "buffers": "use smaller gradient buckets (zero.reduce_bucket_size) or parameter units "
            "(zero.module_granularity_threshold 0)",
        }
        return (
            f"nothing fits: the smallest footprint, {least.name}, needs {_gib(least.memory_bytes)} of "
            f"{_gib(least.memory_limit)} usable, most of it {largest} ({_gib(shares[largest])}): "
            f"{remedy[largest]}"
        )
    c = choice.critical
    parts = [
        f"{choice.name} fits ({_gib(choice.memory_bytes)} of {_gib(choice.memory_limit)} usable) and is "
        f"predicted at {choice.step_s:.3f} s/step: compute {c.compute_s:.3f} s + exposed communication / "
        f"update {c.exposed_s:.3f} s; it receives {c.step_bytes[1] / 1e9:.2f} GB inter-node and "
        f"{c.step_bytes[0] / 1e9:.2f} GB intra-node per rank per step"
    ]
    fastest = rows[0]
    if fastest is not choice:
        parts.append(
            f"{fastest.name} is {100 * (1 - fastest.step_s / choice.step_s):.1f} % faster, within "
            f"the {100 * tie:.0f} % tie margin, but holds {_gib(fastest.memory_bytes)}, so the "
            f"smaller footprint wins"
        )
    if runner is not None:
        r = runner.critical
        gap = 100 * (runner.step_s / choice.step_s - 1)
        parts.append(
            f"runner-up {runner.name}: {runner.step_s:.3f} s/step ({gap:+.1f} %), "
            f"{_gib(runner.memory_bytes)}, {r.step_bytes[1] / 1e9:.2f} GB inter-node"
        )
    unfit = [p for p in rows if not p.fits and p.step_s < choice.step_s]
    if unfit:
        parts.append(
            f"{len(unfit)} faster option(s) do not fit, e.g. {unfit[0].name} needs {_gib(unfit[0].memory_bytes)}"
        )
    return "; ".join(parts)


def plan(
    shapes: list[StageShape],
    workload: Workload,
    cluster: Cluster,
    *,
    fixed_zeropp: ZeroPP | None = None,
    tie: float = TIE,
    allowed: Callable[[Strategy], bool] = lambda s: True,
) -> Plan:
    """Predict every option, sort (fitting, fastest, smallest) and pick the recommendation."""
    rows = sorted(
        (predict(o, shapes, workload, cluster) for o in options(workload, cluster, fixed_zeropp, allowed)),
        key=_sort_key,
    )
    choice, runner = pick(rows, tie)
    return Plan(rows, choice, runner, _reason(choice, runner, rows, tie))


class Priced(Protocol):
    """What the recommendation rule reads of a row (a `Prediction`, a two-level row)."""

    @property
    def fits(self) -> bool: ...
    @property
    def step_s(self) -> float: ...
    @property
    def memory_bytes(self) -> float: ...

    memory_limit: float


P = TypeVar("P", bound=Priced)


def pick(rows: Sequence[P], tie: float = TIE) -> tuple[P | None, P | None]:
    """(recommendation, runner-up) of `rows` sorted fitting first, fastest first: the module
    docstring's near-tie rule."""
    fitting = [p for p in rows if p.fits]
    if not fitting:
        return None, None
    close = [p for p in fitting if p.step_s <= fitting[0].step_s * (1 + tie)]
    least = min(p.memory_bytes for p in close)
    choice = next(p for p in close if p.memory_bytes <= least + SAME_MEMORY * p.memory_limit)
    return choice, next((p for p in fitting if p is not choice), None)
