"""Closed-form model-state bytes and communication bytes of every PaRO strategy.

Why one module: the engine, its tests, the benchmark and the future auto-planner must agree
on what a strategy costs. The engine also uses `collectives` here to decide which collective
sequence to run, so the sequence documented in docs/arch/zero.md, the one executed and the one
predicted are the same table.

Notation (per bucket): P = padded element count (a multiple of the DP size D), k = PaRO group
size, m = D / k. Level N holds P elements, I holds P / k, G holds P / D. A micro-batch step has
A micro-batches. Byte counts follow the convention of megazpp.parallel.comm: a rank counts what
it receives from each other member of a collective, classed intra/inter by the member's node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from megazpp.zero.strategy import Level, Strategy

ADAM_STATE_BYTES_PER_ELEMENT = 12  # fp32 master + fp32 exp_avg + fp32 exp_avg_sq


@dataclass(frozen=True)
class GroupShape:
    """Members of a communication group as seen from one rank: how many peers share its node."""

    size: int
    intra_peers: int
    inter_peers: int

    @staticmethod
    def of(ranks: Sequence[int], me: int, ranks_per_node: int) -> "GroupShape":
        node = me // ranks_per_node
        intra = sum(1 for r in ranks if r != me and r // ranks_per_node == node)
        return GroupShape(len(ranks), intra, len(ranks) - 1 - intra)


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
    def k(self) -> int:
        return self.intra.size

    @property
    def d(self) -> int:
        return self.dp.size


def paro_group_ranks(dp_ranks: Sequence[int], k: int, dp_index: int) -> tuple[list[int], list[int]]:
    """(my PaRO group, my cross group) as global ranks, for DP member `dp_index` of `dp_ranks`."""
    gi, local = divmod(dp_index, k)
    intra = list(dp_ranks[gi * k:(gi + 1) * k])
    cross = [dp_ranks[j * k + local] for j in range(len(dp_ranks) // k)]
    return intra, cross


def dp_shapes(dp_ranks: Sequence[int], k: int, me: int, ranks_per_node: int, hpz: int = 1) -> DPShapes:
    index = list(dp_ranks).index(me)
    intra, cross = paro_group_ranks(dp_ranks, k, index)
    secondary, _ = paro_group_ranks(dp_ranks, hpz, index)
    return DPShapes(GroupShape.of(dp_ranks, me, ranks_per_node), GroupShape.of(intra, me, ranks_per_node),
                    GroupShape.of(cross, me, ranks_per_node), GroupShape.of(secondary, me, ranks_per_node))


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


def level_div(level: Level, d: int, k: int) -> int:
    return {Level.N: 1, Level.I: k, Level.G: d}[level]


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
    if s.os == Level.N:  # NNN: plain data parallelism
        if hier.all_reduce:
            return [Collective("reduce_scatter", "intra", 1), Collective("all_reduce", "cross", k),
                    Collective("all_gather", "intra", 1)]
        return [Collective("all_reduce", "dp", 1)]
    seq = reduce_sequence(s.g, s.os, k, hier)
    if s.os == Level.I:  # the group sum of the I-chunk still lacks the other groups
        seq.append(Collective("all_reduce", "cross", k))
    return seq


def micro_batch_reduce_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """After each micro-batch's backward: bring the fresh gradient down to level g."""
    return reduce_sequence(Level.N, s.g, k, hier)


def param_fetch_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """Before a fetch group's forward and (unless it is kept) its backward: rebuild full
    parameters."""
    return gather_sequence(s.p, Level.N, k, hier)


def param_sync_sequence(s: Strategy, k: int, hier: Hierarchy) -> list[Collective]:
    """After the optimizer updated the os shard: refresh the parameter shard at level p."""
    return gather_sequence(s.os, s.p, k, hier)


@dataclass(frozen=True)
class QuantFormat:
    """A block-quantized wire format (ZeRO++): `bits`-bit codes plus one fp32 scale per `block`."""

    bits: int
    block: int

    def nbytes(self, numel: int) -> int:
        """Wire bytes of `numel` elements; exact because every chunk is block-aligned."""
        return numel * self.bits // 8 + numel // self.block * 4


ElemFormat = int | QuantFormat  # bytes per element of a plain dtype, or a quantized format


def _nbytes(numel: int, fmt: ElemFormat) -> int:
    return fmt.nbytes(numel) if isinstance(fmt, QuantFormat) else numel * fmt


def collective_bytes(c: Collective, padded_numel: int, elem: ElemFormat, shapes: DPShapes,
                     side: int = 0) -> tuple[int, int]:
    """(intra, inter) bytes this rank receives for collective `c`, by comm's convention;
    `side`: bytes each peer's chunk carries besides `elem` (qgZ's exactly sent values)."""
    g: GroupShape = getattr(shapes, c.group)
    nbytes = _nbytes(padded_numel // c.numel_div, elem)
    if g.size == 1:
        return 0, 0
    if c.op == "all_reduce":
        return all_reduce_bytes(nbytes, g)
    per_peer = nbytes // g.size + side
    return per_peer * g.intra_peers, per_peer * g.inter_peers


def sequence_bytes(seq: Iterable[Collective], padded_numel: int, elem: ElemFormat,
                   shapes: DPShapes, sides: Sequence[int] = ()) -> tuple[int, int]:
    """`sides`: per collective of `seq`, the `side` bytes of `collective_bytes` (default none)."""
    intra = inter = 0
    for i, c in enumerate(seq):
        a, b = collective_bytes(c, padded_numel, elem, shapes, sides[i] if sides else 0)
        intra, inter = intra + a, inter + b
    return intra, inter


HIERARCHY_MODES = ("auto", "always", "never")  # config key zero.hierarchical


def choose_hierarchy(shapes: DPShapes, mode: str | Hierarchy = "auto") -> Hierarchy:
    """Which G-level collectives run in two stages: `mode` one of HIERARCHY_MODES, or a
    Hierarchy decided above this layer (the planner's host model prices each kind of
    collective, `planner.cost.fastest_hierarchy`), taken as given. "auto" here, with no
    prices, is the byte rule: two stages where they move fewer inter-node bytes, decided on a
    unit payload so the answer does not depend on bucket sizes.

    A degenerate split (k = 1 or k = D) is never hierarchical since one of its stages would be
    a no-op.
    """
    if shapes.k in (1, shapes.d) or mode == "never":
        return Hierarchy()
    if isinstance(mode, Hierarchy):
        return mode
    if mode == "always":
        return Hierarchy(True, True, True)
    unit = shapes.d * shapes.k * 8
    flat, hier = Hierarchy(), Hierarchy(True, True, True)
    pick = {}
    for name, seq_of in (("gather", lambda h: gather_sequence(Level.G, Level.N, shapes.k, h)),
                         ("reduce", lambda h: reduce_sequence(Level.N, Level.G, shapes.k, h)),
                         ("all_reduce", lambda h: boundary_sequence(Strategy(Level.N, Level.N, Level.N),
                                                                    shapes.k, h))):
        pick[name] = sequence_bytes(seq_of(hier), unit, 1, shapes)[1] < sequence_bytes(seq_of(flat), unit, 1, shapes)[1]
    return Hierarchy(**pick)


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds between steps."""

    params: int
    grads: int
    optimizer: int
    path_state: int = 0  # ZeRO++: hpZ secondary shard, LoCo error buffers

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.path_state


def state_bytes(s: Strategy, padded_numels: Iterable[int], d: int, k: int, param_bytes: int,
                accum_bytes: int, persistent: int = 0) -> StateBytes:
    """Parameters at p (model dtype), gradient accumulators at g, fp32 master + Adam at os; the
    last `persistent` buckets hold their parameters whole (`units.split_persistent`)."""
    params = grads = optim = 0
    numels = list(padded_numels)
    for i, n in enumerate(numels):
        params += n // level_div(Level.N if i >= len(numels) - persistent else s.p, d, k) * param_bytes
        grads += n // level_div(s.g, d, k) * accum_bytes
        optim += n // level_div(s.os, d, k) * ADAM_STATE_BYTES_PER_ELEMENT
    return StateBytes(params, grads, optim)


def norm_groups(s: Strategy) -> list[str]:
    """DP groups the squared-gradient-norm scalar is summed over (the os shard's owners)."""
    return {Level.N: [], Level.I: ["intra"], Level.G: ["dp"]}[s.os]


STEP_PHASES = ("fetch_forward", "fetch_forward_once", "fetch_backward", "micro_reduce", "boundary", "refresh",
               "refresh_persistent")


def reuse_mask(numels: Sequence[int], max_live: int, max_reuse_distance: int) -> tuple[bool, ...]:
    """Per fetch group (in forward order): is it kept gathered from its forward to its backward?

    DeepSpeed's meaning of `stage3_max_reuse_distance` / `stage3_max_live_parameters`: a group
    is not released after its forward when its next use (its backward) comes within
    `max_reuse_distance` parameter elements used in between (the later groups' forward and
    backward: 2 x their elements), and the groups kept stay within `max_live` elements. The
    last groups of the forward are reused soonest, so groups are kept from the end while both
    bounds hold. Checkpointed layers need no separate rule: their recompute runs inside
    backward, where a gathered group is never released before its gradients are in.
    """
    kept = [False] * len(numels)
    live = later = 0
    for i in range(len(numels) - 1, -1, -1):
        if 2 * later > max_reuse_distance or live + numels[i] > max_live:
            break
        kept[i] = True
        live += numels[i]
        later += numels[i]
    return tuple(kept)


@dataclass(frozen=True)
class StepPart:
    """One communication phase of a step: the sequence run on each of its buckets, the wire
    format, how often per step, and the padded sizes of the buckets it moves."""

    sequence: tuple[Collective, ...]
    elem: ElemFormat
    times: int
    numels: tuple[int, ...]
    sides: tuple[tuple[int, ...], ...] = ()  # per bucket, per collective: extra bytes per peer

    def bytes_once(self, shapes: DPShapes) -> tuple[int, int]:
        """(intra, inter) bytes of one occurrence over all its buckets."""
        intra = inter = 0
        for i, n in enumerate(self.numels):
            a, b = sequence_bytes(self.sequence, n, self.elem, shapes, self.sides[i] if self.sides else ())
            intra, inter = intra + a, inter + b
        return intra, inter

    def calls_once(self, shapes: DPShapes) -> int:
        """Collective calls of one occurrence over all its buckets (a group of one is skipped)."""
        return len(self.numels) * sum(1 for c in self.sequence if getattr(shapes, c.group).size > 1)


def step_parts(s: Strategy, padded_numels: Iterable[int], shapes: DPShapes, hier: Hierarchy, *,
               micro_batches: int, param_bytes: int, accum_bytes: int, zeropp: "ZeroPP | None" = None,
               reused: Sequence[bool] = (), exact_ranges: Sequence[Sequence[tuple[int, int]]] = (),
               persistent: int = 0, warmup: int = 0) -> dict[str, StepPart]:
    """The phases `step_bytes` sums (keys `STEP_PHASES`), for callers that also need to know
    when the bytes move (the planner's overlap model).

    Per micro-batch, when p is sharded: a fetch of each group before its forward, and one before
    its backward unless `reused[i]` says group i stays gathered from forward to backward
    (`reuse_mask`). Activation checkpointing adds no fetch: the recompute runs inside backward,
    right before the group's backward, and finds it gathered (or gathers it as the backward
    fetch: under hpZ from the secondary shard, under qwZ without hpZ the quantized primary).
    Then one gradient reduction to g per micro-batch, and per step the boundary reduction to os
    (accumulation dtype) and the parameter refresh to p. With ZeRO++ (`zeropp`) the fetches and
    the micro-batch reduction take its sequences and formats; `exact_ranges` (per bucket, the
    flat ranges of the tensors qgZ and qwZ send exactly: `BucketLayout.vector_ranges`) add
    their side payload (qgZ: fp32, `qgz_exact_widths`; qwZ: model dtype, `qwz_exact_sides`). The last `persistent` buckets (parameters
    below `stage3_param_persistence_threshold`, whole on every rank) are never fetched; they are
    reduced like the rest and refreshed from os to N (`refresh_persistent`), one collective per
    stage each (`reused` covers the fetch groups before them).

    `warmup`: forward passes this pipeline stage runs before its first backward under 1F1B
    (`min(PP - stage - 1, A)`). With one or more, a group kept for backward stays gathered from
    the first forward of the step to the last backward (each later forward finds it kept for a
    backward still to come), so it is fetched once per step (`fetch_forward_once`) instead of
    once per micro-batch.
    """
    k = shapes.k
    pp = zeropp or ZeroPP()
    numels = tuple(padded_numels)
    fetched, whole = numels[:len(numels) - persistent], numels[len(numels) - persistent:]
    kept = [i < len(reused) and reused[i] for i in range(len(fetched))]
    again = tuple(n for n, keep in zip(fetched, kept) if not keep)
    once = tuple(n for n, keep in zip(fetched, kept) if keep) if warmup > 0 else ()
    every = again if warmup > 0 else fetched
    fetch = tuple(param_fetch_sequence(s, k, hier))
    weights: ElemFormat = pp.weights if pp.qwz else param_bytes
    fetch_sides: tuple[tuple[int, ...], ...] = ()
    if pp.qwz and exact_ranges:
        fetch_sides = tuple(qwz_exact_sides(fetch, shapes, n, level_div(s.p, shapes.d, k), r, param_bytes)
                            for n, r in zip(fetched, exact_ranges))

    def sides_where(keep: Sequence[bool]) -> tuple[tuple[int, ...], ...]:
        return tuple(side for side, yes in zip(fetch_sides, keep) if yes)

    again_sides = sides_where([not keep for keep in kept])
    once_sides = sides_where(kept) if warmup > 0 else ()
    every_sides = again_sides if warmup > 0 else fetch_sides
    backward = ((tuple(hpz_fetch_sequence()), param_bytes, micro_batches, again) if pp.hpz > 1
                else (fetch, weights, micro_batches, again, again_sides))
    sides: tuple[tuple[int, ...], ...] = ()
    if pp.qgz:
        qseq = qgz_sequence(s, shapes)
        micro = (tuple(qseq), pp.grads)
        if exact_ranges:
            sides = tuple(tuple(4 * w for w in qgz_exact_widths(qseq, shapes, n, r))
                          for n, r in zip(numels, exact_ranges))
    else:
        micro = (tuple(micro_batch_reduce_sequence(s, k, hier)), param_bytes)
    return {"fetch_forward": StepPart(fetch, weights, micro_batches, every, every_sides),
            "fetch_forward_once": StepPart(fetch, weights, 1, once, once_sides),
            "fetch_backward": StepPart(*backward),
            "micro_reduce": StepPart(*micro, micro_batches, numels, sides),
            "boundary": StepPart(tuple(boundary_sequence(s, k, hier)), accum_bytes, 1, numels),
            "refresh": StepPart(tuple(param_sync_sequence(s, k, hier)), param_bytes, 1, fetched),
            "refresh_persistent": StepPart(tuple(gather_sequence(s.os, Level.N, k, hier)), param_bytes, 1, whole)}


def norm_shapes(s: Strategy, shapes: DPShapes, extra_norm_groups: Sequence[GroupShape] = ()) -> list[GroupShape]:
    """Groups the fp32 squared-norm scalar is all-reduced over: the os owners, then the
    tensor / pipeline groups."""
    return [getattr(shapes, g) for g in norm_groups(s)] + list(extra_norm_groups)


def all_reduce_bytes(nbytes: int, g: GroupShape) -> tuple[int, int]:
    """(intra, inter) bytes one rank receives in an all-reduce of `nbytes` over `g`."""
    if g.size == 1:
        return 0, 0
    return 2 * nbytes * g.intra_peers // g.size, 2 * nbytes * g.inter_peers // g.size


def step_bytes(s: Strategy, padded_numels: Iterable[int], shapes: DPShapes, hier: Hierarchy, *,
               micro_batches: int, param_bytes: int, accum_bytes: int,
               extra_norm_groups: Sequence[GroupShape] = (), zeropp: "ZeroPP | None" = None,
               reused: Sequence[bool] = (), exact_ranges: Sequence[Sequence[tuple[int, int]]] = (),
               persistent: int = 0, warmup: int = 0) -> tuple[int, int]:
    """(intra, inter) bytes one rank receives in one optimizer step of `micro_batches`: the
    phases of `step_parts`, plus one fp32 all-reduce of the squared norm over the os owners
    and over `extra_norm_groups` (tensor / pipeline groups)."""
    intra = inter = 0
    parts = step_parts(s, padded_numels, shapes, hier, micro_batches=micro_batches, param_bytes=param_bytes,
                       accum_bytes=accum_bytes, zeropp=zeropp, reused=reused, exact_ranges=exact_ranges,
                       persistent=persistent, warmup=warmup)
    for part in parts.values():
        a, b = part.bytes_once(shapes)
        intra, inter = intra + part.times * a, inter + part.times * b
    for g in norm_shapes(s, shapes, extra_norm_groups):
        a, b = all_reduce_bytes(4, g)
        intra, inter = intra + a, inter + b
    return intra, inter


def step_calls(s: Strategy, padded_numels: Iterable[int], shapes: DPShapes, hier: Hierarchy, *,
               micro_batches: int, extra_norm_groups: Sequence[GroupShape] = (),
               zeropp: "ZeroPP | None" = None, reused: Sequence[bool] = (), persistent: int = 0,
               warmup: int = 0) -> int:
    """Collective calls one rank issues in one optimizer step: every collective of every phase
    of `step_parts` on every bucket, except those over a group of one (the engine skips them),
    plus one norm all-reduce per norm group of more than one rank. On CPU ranks each call costs
    a fixed host time whatever its size, which is why fetch groups exist (units.fetch_groups)."""
    parts = step_parts(s, padded_numels, shapes, hier, micro_batches=micro_batches, param_bytes=1,
                       accum_bytes=1, zeropp=zeropp, reused=reused, persistent=persistent, warmup=warmup)
    calls = sum(part.times * part.calls_once(shapes) for part in parts.values())
    return calls + sum(1 for g in norm_shapes(s, shapes, extra_norm_groups) if g.size > 1)


# -- ZeRO++ (qwZ, hpZ, qgZ) and LoCo -------------------------------------------------------------

@dataclass(frozen=True)
class ZeroPP:
    """Which ZeRO++ paths are on, their quantization blocks, and which CPU kernels run them.

    qwZ: parameter gathers from the primary shard move int8 codes + scales (`weights`).
    hpZ: `hpz` > 1 keeps a secondary copy of the parameters split over `hpz` DP ranks of one
    node, filled from the forward gather; backward gathers only from it (`hpz_fetch_sequence`).
    qgZ: the per-micro-batch gradient reduction is one int4 all-to-all per stage
    (`qgz_sequence`, `grads`); `loco` adds LoCo error feedback to both stages.
    """

    qwz: bool = False
    hpz: int = 1
    qgz: bool = False
    loco: bool = False
    qwz_block: int = 2048
    qgz_block: int = 256
    err_beta: float = 0.8  # LoCo: weight of the old error in the blended buffer
    reset_t: int = 1024  # LoCo: buffers are zeroed after every reset_t optimizer steps
    cpu_kernels: str = "reference"  # kernels.CPU_KERNELS: eager torch, or compiled by TorchInductor

    @property
    def enabled(self) -> bool:
        return self.qwz or self.hpz > 1 or self.qgz

    @property
    def weights(self) -> QuantFormat:
        return QuantFormat(8, self.qwz_block)

    @property
    def grads(self) -> QuantFormat:
        return QuantFormat(4, self.qgz_block)

    def alignment(self) -> int:
        """Elements every DP shard of a bucket must be a multiple of, so that each chunk of
        every quantized all-gather / all-to-all is whole blocks (no unquantized fallback)."""
        blocks = [b for on, b in ((self.qwz, self.qwz_block), (self.qgz, self.qgz_block)) if on]
        return math.lcm(*blocks) if blocks else 1


def hpz_fetch_sequence() -> list[Collective]:
    """hpZ's backward fetch: all-gather of the secondary shard inside its (intra-node) group."""
    return [Collective("all_gather", "hpz", 1)]


def qgz_sequence(s: Strategy, shapes: DPShapes) -> list[Collective]:
    """qgZ's reduction N -> g as int4 all-to-alls: inside the PaRO group (each member gets the
    I-chunk it reduces), then, for g = G, across the cross group (each gets its G-piece of the
    reduced I-chunk). A stage over a group of one moves nothing and is left out."""
    seq = []
    if shapes.k > 1:
        seq.append(Collective("all_to_all", "intra", 1))
    if s.g == Level.G and shapes.cross.size > 1:
        seq.append(Collective("all_to_all", "cross", shapes.k))
    return seq


def chunk_ranges(ranges: Sequence[tuple[int, int]], numel: int, parts: int) -> list[list[tuple[int, int]]]:
    """`ranges` (sorted, disjoint [start, end) in a buffer of `numel`) cut by `parts` equal
    chunks, each chunk's pieces relative to the chunk's start."""
    size = numel // parts
    out: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    for a, b in ranges:
        for j in range(a // size, -(-b // size)):
            lo, hi = max(a, j * size), min(b, (j + 1) * size)
            if lo < hi:
                out[j].append((lo - j * size, hi - j * size))
    return out


def qgz_exact_widths(seq: Sequence[Collective], shapes: DPShapes, padded: int,
                     exact: Sequence[tuple[int, int]]) -> list[int]:
    """fp32 values each peer's chunk carries besides its int4 codes, per qgZ stage.

    qgZ sends the tensors in `exact` (norm gains, biases: `BucketLayout.vector_ranges`)
    exactly: each chunk of a stage carries its values of them as fp32, padded to the most
    any chunk of that granularity in the bucket holds, so every peer's chunk has one size
    (the all-to-all needs equal splits) and the width needs no rank's position."""
    return [most_per_chunk(exact, padded, c.numel_div * getattr(shapes, c.group).size) for c in seq]


def most_per_chunk(ranges: Sequence[tuple[int, int]], numel: int, parts: int) -> int:
    """The most elements of `ranges` that any of `parts` equal chunks of `numel` holds."""
    return max((sum(b - a for a, b in piece) for piece in chunk_ranges(ranges, numel, parts)), default=0)


def qwz_exact_sides(seq: Sequence[Collective], shapes: DPShapes, padded: int, p_div: int,
                    exact: Sequence[tuple[int, int]], param_bytes: int) -> tuple[int, ...]:
    """Bytes each peer's chunk carries besides its int8 codes, per collective of qwZ's gather.

    qwZ sends the tensors in `exact` exactly, like qgZ: each of the `p_div` p-level shards
    carries its values of them in the model dtype, padded to the most any shard holds
    (`most_per_chunk`), and a peer's chunk in a gather stage is whole shards."""
    width = most_per_chunk(exact, padded, p_div) * param_bytes
    return tuple(p_div // (c.numel_div * getattr(shapes, c.group).size) * width for c in seq)


def zeropp_state_bytes(padded_numels: Iterable[int], shapes: DPShapes, zeropp: ZeroPP,
                       param_bytes: int, strategy: Strategy, persistent: int = 0) -> int:
    """Per-rank bytes of ZeRO++ path state: hpZ's secondary shard (model dtype; not for the last
    `persistent` buckets, never fetched) and LoCo's error buffers (fp32, one per stage), twice:
    the live buffers and the copy a skipped step restores (`loco.LocoState`)."""
    total = 0
    numels = list(padded_numels)
    for i, n in enumerate(numels):
        if zeropp.hpz > 1 and i < len(numels) - persistent:
            total += n // zeropp.hpz * param_bytes
        if zeropp.loco:
            for c in qgz_sequence(strategy, shapes):
                total += 2 * 4 * (n // c.numel_div)
    return total


def tensor_offsets(numels: Sequence[int], align: int = 1) -> tuple[list[int], int]:
    """Flat offsets of tensors laid out in order, each starting at a multiple of `align`
    (ZeRO++: no quantization block holds values of two tensors), and the end of the last."""
    offsets, pos = [], 0
    for n in numels:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += n
    return offsets, pos


def tensor_layout(tensors: Sequence[tuple[int, bool]], d: int, align: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """A bucket of `tensors` ((numel, is 1-D) in layout order): its padded size and the flat
    ranges of its 1-D tensors (what qgZ sends exactly), as `BucketLayout` lays it out."""
    offsets, end = tensor_offsets([n for n, _ in tensors], align)
    return padded_numel(end, d, align), [(o, o + n) for o, (n, vector) in zip(offsets, tensors) if vector]


def padded_numel(numel: int, d: int, align: int = 1) -> int:
    """Round a bucket up to a multiple of the DP size (times ZeRO++'s block `align`) so every
    level divides it evenly and every quantized chunk is whole blocks."""
    unit = d * align
    return -(-numel // unit) * unit
