"""Which collectives a PaRO strategy runs, over which of its data-parallel groups.

Why one table: the engine runs these sequences (`collectives.PendingSequence`), and the byte
and call formulas (`traffic`) and the planner price the very same lists, so what is predicted
is what is executed (docs/arch/zero.md lists them per strategy).

Notation (per bucket): P = padded element count (a multiple of the DP size D), k = PaRO group
size, m = D / k. Level N holds P elements, I holds P / k, G holds P / D (`strategy.level_div`).
A `Collective`'s `numel_div` sizes its tensor as P / numel_div.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megazpp.parallel.wire import GroupShape
from megazpp.zero.strategy import Level, Strategy


@dataclass(frozen=True)
class DPShapes:
    """The three data-parallel groups a strategy uses: all DP ranks, my PaRO group, my column.

    `cross` is the set of DP ranks that hold the same position inside their PaRO group; it is
    the group of the second (inter-group) stage of every hierarchical collective.
    """

    dp: GroupShape
    intra: GroupShape
    cross: GroupShape
    hpz: GroupShape = GroupShape(1, 0, 0)  # ZeRO++ hpZ's secondary group (size 1: hpZ off)

    @property
    def group_size(self) -> int:
        return self.intra.size

    @property
    def dp_size(self) -> int:
        return self.dp.size


def paro_group_ranks(dp_ranks: Sequence[int], k: int, dp_index: int) -> tuple[list[int], list[int]]:
    """(my PaRO group, my cross group) as global ranks, for DP member `dp_index` of `dp_ranks`."""
    gi, local = divmod(dp_index, k)
    intra = list(dp_ranks[gi * k : (gi + 1) * k])
    cross = [dp_ranks[j * k + local] for j in range(len(dp_ranks) // k)]
    return intra, cross


def dp_shapes(
    dp_ranks: Sequence[int], k: int, me: int, ranks_per_node: int, hpz: int = 1, backend: str = "nccl"
) -> DPShapes:
    """The groups of DP member `me`; `backend` decides what their collectives put on which link
    (`megazpp.parallel.wire`)."""
    index = list(dp_ranks).index(me)
    intra, cross = paro_group_ranks(dp_ranks, k, index)
    secondary, _ = paro_group_ranks(dp_ranks, hpz, index)
    return DPShapes(
        *(GroupShape.of(ranks, me, ranks_per_node, backend) for ranks in (dp_ranks, intra, cross, secondary))
    )


@dataclass(frozen=True)
class Collective:
    """One collective of a strategy's sequence.

    `numel_div` gives the tensor size as P / numel_div: the OUTPUT of an all-gather, the INPUT
    of a reduce-scatter or all-reduce (the sizes the comm counter reads).
    """

    op: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all"
    group: str  # "dp" | "intra" | "cross" | "hpz"
    numel_div: int


@dataclass(frozen=True)
class Hierarchy:
    """Whether each G-level collective runs in two stages (PaRO group, then cross group)."""

    gather: bool = False
    reduce: bool = False
    all_reduce: bool = False


def gather_sequence(src: Level, dst: Level, k: int, hier: Hierarchy) -> list[Collective]:
    """Collectives that rebuild level `dst` (coarser) from shards at level `src`."""
    if src <= dst:
        return []
    if src == Level.I:  # I -> N
        return [Collective("all_gather", "intra", 1)]
    if dst == Level.I:  # G -> I
        return [Collective("all_gather", "cross", k)]
    if hier.gather:  # G -> N in two stages: columns first, then inside the group
        return [Collective("all_gather", "cross", k), Collective("all_gather", "intra", 1)]
    return [Collective("all_gather", "dp", 1)]


def reduce_sequence(src: Level, dst: Level, k: int, hier: Hierarchy) -> list[Collective]:
    """Collectives that sum gradients held at level `src` into shards at level `dst` (finer).

    Reducing to I gives the sum over the PaRO group only; `boundary_sequence` adds the
    cross-group sum when the optimizer state sits at I.
    """
    if dst <= src:
        return []
    if dst == Level.I:  # N -> I
        return [Collective("reduce_scatter", "intra", 1)]
    if src == Level.I:  # I -> G
        return [Collective("reduce_scatter", "cross", k)]
    if hier.reduce:  # N -> G: inside the group first (fast link), then the 1/k chunk across
        return [Collective("reduce_scatter", "intra", 1), Collective("reduce_scatter", "cross", k)]
    return [Collective("reduce_scatter", "dp", 1)]


def boundary_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """Once per step: take the accumulated gradient from level g to the full sum at level os."""
    if s.optimizer_state == Level.N:  # NNN: plain data parallelism
        if hier.all_reduce:
            return [
                Collective("reduce_scatter", "intra", 1),
                Collective("all_reduce", "cross", k),
                Collective("all_gather", "intra", 1),
            ]
        return [Collective("all_reduce", "dp", 1)]
    seq = reduce_sequence(s.grads, s.optimizer_state, k, hier)
    if s.optimizer_state == Level.I:  # the group sum of the I-chunk still lacks the other groups
        seq.append(Collective("all_reduce", "cross", k))
    return seq


def micro_batch_reduce_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """After each micro-batch's backward: bring the fresh gradient down to level g."""
    return reduce_sequence(Level.N, s.grads, k, hier)


def param_fetch_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """Before a fetch group's forward and (unless it is kept) its backward: rebuild full
    parameters."""
    return gather_sequence(s.params, Level.N, k, hier)


def param_sync_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """After the optimizer updated the os shard: refresh the parameter shard at level p."""
    return gather_sequence(s.optimizer_state, s.params, k, hier)


def hpz_fetch_sequence() -> list[Collective]:
    """hpZ's backward fetch: all-gather of the secondary shard inside its (intra-node) group."""
    return [Collective("all_gather", "hpz", 1)]


def qgz_sequence(s: Strategy, shapes: DPShapes, hier: Hierarchy) -> list[Collective]:
    """qgZ's reduction N -> g as int4 all-to-alls: inside the PaRO group (each member gets the
    I-chunk it reduces), then, for g = G, across the cross group (each gets its G-piece of the
    reduced I-chunk). A stage over a group of one moves nothing and is left out. With the
    reductions single-stage (`hier.reduce` false) g = G takes one all-to-all over all DP ranks
    instead: one call and one dequantize-sum where the two hops take two calls and a
    requantization between them, for k times the inter-node bytes of the second hop."""
    if s.grads == Level.G and not hier.reduce and 1 < shapes.group_size < shapes.dp.size:
        return [Collective("all_to_all", "dp", 1)]
    seq = []
    if shapes.group_size > 1:
        seq.append(Collective("all_to_all", "intra", 1))
    if s.grads == Level.G and shapes.cross.size > 1:
        seq.append(Collective("all_to_all", "cross", shapes.group_size))
    return seq


def norm_groups(s: Strategy) -> list[str]:
    """DP groups the squared-gradient-norm scalar is summed over (the os shard's owners)."""
    return {Level.N: [], Level.I: ["intra"], Level.G: ["dp"]}[s.optimizer_state]
