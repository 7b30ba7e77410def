"""Bytes each rank receives and collective calls it issues in one optimizer step.

Why here and not in the engine: the engine's tests, the strategy benchmark and the planner
must agree on what a strategy costs, so every one of them sums the same phases
(`step_parts`) over the sequences of `sequences`. Byte counts follow the convention of
megazpp.parallel.comm, per the backend the groups carry (`GroupShape.backend`): the bytes the
backend's algorithm puts on each link class, as `megazpp.parallel.wire` models it (the one
formula the counter records). A micro-batch step has A micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from megazpp.parallel.wire import GroupShape, all_reduce_bytes, chunk_bytes
from megazpp.zero.sequences import (
    Collective,
    DPShapes,
    Hierarchy,
    boundary_sequence,
    gather_sequence,
    hpz_fetch_sequence,
    micro_batch_reduce_sequence,
    norm_groups,
    param_fetch_sequence,
    param_sync_sequence,
    qgz_sequence,
    reduce_sequence,
)
from megazpp.zero.strategy import Level, Strategy, level_div
from megazpp.zero.zeropp import QuantFormat, ZeroPP

ElemFormat = int | QuantFormat  # bytes per element of a plain dtype, or a quantized format


def _nbytes(numel: int, fmt: ElemFormat) -> int:
    return fmt.nbytes(numel) if isinstance(fmt, QuantFormat) else numel * fmt


def collective_bytes(
    c: Collective, padded_numel: int, elem: ElemFormat, shapes: DPShapes, side: int = 0
) -> tuple[int, int]:
    """(intra, inter) bytes this rank is counted for collective `c` (`wire`'s model for the
    group's backend); `side`: bytes each peer's chunk carries besides `elem` (qgZ's exactly
    sent values)."""
    g: GroupShape = getattr(shapes, c.group)
    nbytes = _nbytes(padded_numel // c.numel_div, elem)
    if g.size == 1:
        return 0, 0
    if c.op == "all_reduce":
        return all_reduce_bytes(nbytes, g)
    return chunk_bytes(c.op, g, nbytes // g.size + side)


def sequence_bytes(
    seq: Iterable[Collective], padded_numel: int, elem: ElemFormat, shapes: DPShapes, sides: Sequence[int] = ()
) -> tuple[int, int]:
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
    if shapes.group_size in (1, shapes.dp_size) or mode == "never":
        return Hierarchy()
    if isinstance(mode, Hierarchy):
        return mode
    if mode == "always":
        return Hierarchy(True, True, True)
    unit = shapes.dp_size * shapes.group_size * 8
    flat, hier = Hierarchy(), Hierarchy(True, True, True)
    pick = {}
    kinds: tuple[tuple[str, Callable[[Hierarchy], list[Collective]]], ...] = (
        ("gather", lambda h: gather_sequence(Level.G, Level.N, shapes.group_size, h)),
        ("reduce", lambda h: reduce_sequence(Level.N, Level.G, shapes.group_size, h)),
        ("all_reduce", lambda h: boundary_sequence(Strategy(Level.N, Level.N, Level.N), shapes.group_size, h)),
    )
    for name, seq_of in kinds:
        pick[name] = sequence_bytes(seq_of(hier), unit, 1, shapes)[1] < sequence_bytes(seq_of(flat), unit, 1, shapes)[1]
    return Hierarchy(**pick)


STEP_PHASES = (
    "fetch_forward",
    "fetch_forward_once",
    "fetch_backward",
    "micro_reduce",
    "boundary",
    "refresh",
    "refresh_persistent",
)


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


def step_parts(
    s: Strategy,
    padded_numels: Iterable[int],
    shapes: DPShapes,
    hier: Hierarchy,
    *,
    micro_batches: int,
    param_bytes: int,
    accum_bytes: int,
    zeropp: ZeroPP | None = None,
    reused: Sequence[bool] = (),
    exact_ranges: Sequence[Sequence[tuple[int, int]]] = (),
    persistent: int = 0,
) -> dict[str, StepPart]:
    """The phases `step_bytes` sums (keys `STEP_PHASES`), for callers that also need to know
    when the bytes move (the planner's overlap model).

    When p is sharded: a group kept (`reused[i]`, `reuse_mask`) is fetched once per step, before
    its first forward, and stays gathered to the optimizer step (`fetch_forward_once`): holding
    it between micro-batches holds no more than the start of every backward, where each kept
    group is gathered. Each other group is fetched per micro-batch before its forward and again
    before its backward. Activation checkpointing adds no fetch: the recompute runs inside backward,
    right before the group's backward, and finds it gathered (or gathers it as the backward
    fetch: under hpZ from the secondary shard, under qwZ without hpZ the quantized primary).
    Then one gradient reduction to g per micro-batch, and per step the boundary reduction to os
    (accumulation dtype) and the parameter refresh to p. With ZeRO++ (`zeropp`) the fetches and
    the micro-batch reduction take its sequences and formats; `exact_ranges` (per bucket, the
    flat ranges of the tensors qgZ and qwZ send exactly: `BucketLayout.vector_ranges`) add
    their side payload (qgZ: fp32, `qgz_exact_widths`; qwZ: model dtype, `qwz_exact_sides`).
    The last `persistent` buckets (parameters
    below `stage3_param_persistence_threshold`, whole on every rank) are never fetched; they are
    reduced like the rest and refreshed from os to N (`refresh_persistent`), one collective per
    stage each (`reused` covers the fetch groups before them).
    """
    k = shapes.group_size
    pp = zeropp or ZeroPP()
    numels = tuple(padded_numels)
    fetched, whole = numels[: len(numels) - persistent], numels[len(numels) - persistent :]
    kept = [i < len(reused) and reused[i] for i in range(len(fetched))]
    again = tuple(n for n, keep in zip(fetched, kept) if not keep)
    once = tuple(n for n, keep in zip(fetched, kept) if keep)
    fetch = tuple(param_fetch_sequence(s, k, hier))
    weights: ElemFormat = pp.weights if pp.qwz else param_bytes
    fetch_sides: tuple[tuple[int, ...], ...] = ()
    if pp.qwz and exact_ranges:
        fetch_sides = tuple(
            qwz_exact_sides(fetch, shapes, n, level_div(s.params, shapes.dp_size, k), r, param_bytes)
            for n, r in zip(fetched, exact_ranges)
        )

    def sides_where(keep: Sequence[bool]) -> tuple[tuple[int, ...], ...]:
        return tuple(side for side, yes in zip(fetch_sides, keep) if yes)

    again_sides = sides_where([not keep for keep in kept])
    backward = (
        (tuple(hpz_fetch_sequence()), param_bytes, micro_batches, again)
        if pp.hpz > 1
        else (fetch, weights, micro_batches, again, again_sides)
    )
    sides: tuple[tuple[int, ...], ...] = ()
    if pp.qgz:
        qseq = qgz_sequence(s, shapes, hier)
        micro: tuple[tuple[Collective, ...], ElemFormat] = (tuple(qseq), pp.grads)
        if exact_ranges:
            sides = tuple(
                tuple(4 * w for w in qgz_exact_widths(qseq, shapes, n, r)) for n, r in zip(numels, exact_ranges)
            )
    else:
        micro = (tuple(micro_batch_reduce_sequence(s, k, hier)), param_bytes)
    return {
        "fetch_forward": StepPart(fetch, weights, micro_batches, again, again_sides),
        "fetch_forward_once": StepPart(fetch, weights, 1, once, sides_where(kept)),
        "fetch_backward": StepPart(*backward),
        "micro_reduce": StepPart(*micro, micro_batches, numels, sides),
        "boundary": StepPart(tuple(boundary_sequence(s, k, hier)), accum_bytes, 1, numels),
        "refresh": StepPart(tuple(param_sync_sequence(s, k, hier)), param_bytes, 1, fetched),
        "refresh_persistent": StepPart(
            tuple(gather_sequence(s.optimizer_state, Level.N, k, hier)), param_bytes, 1, whole
        ),
    }


def norm_shapes(s: Strategy, shapes: DPShapes, extra_norm_groups: Sequence[GroupShape] = ()) -> list[GroupShape]:
    """Groups the fp32 squared-norm scalar is all-reduced over: the os owners, then the
    tensor / pipeline groups."""
    return [getattr(shapes, g) for g in norm_groups(s)] + list(extra_norm_groups)


def step_bytes(
    s: Strategy,
    padded_numels: Iterable[int],
    shapes: DPShapes,
    hier: Hierarchy,
    *,
    micro_batches: int,
    param_bytes: int,
    accum_bytes: int,
    extra_norm_groups: Sequence[GroupShape] = (),
    zeropp: ZeroPP | None = None,
    reused: Sequence[bool] = (),
    exact_ranges: Sequence[Sequence[tuple[int, int]]] = (),
    persistent: int = 0,
) -> tuple[int, int]:
    """(intra, inter) bytes one rank receives in one optimizer step of `micro_batches`: the
    phases of `step_parts`, plus one fp32 all-reduce of the squared norm over the os owners
    and over `extra_norm_groups` (tensor / pipeline groups)."""
    intra = inter = 0
    parts = step_parts(
        s,
        padded_numels,
        shapes,
        hier,
        micro_batches=micro_batches,
        param_bytes=param_bytes,
        accum_bytes=accum_bytes,
        zeropp=zeropp,
        reused=reused,
        exact_ranges=exact_ranges,
        persistent=persistent,
    )
    for part in parts.values():
        a, b = part.bytes_once(shapes)
        intra, inter = intra + part.times * a, inter + part.times * b
    for g in norm_shapes(s, shapes, extra_norm_groups):
        a, b = all_reduce_bytes(4, g)
        intra, inter = intra + a, inter + b
    return intra, inter


def step_calls(
    s: Strategy,
    padded_numels: Iterable[int],
    shapes: DPShapes,
    hier: Hierarchy,
    *,
    micro_batches: int,
    extra_norm_groups: Sequence[GroupShape] = (),
    zeropp: ZeroPP | None = None,
    reused: Sequence[bool] = (),
    persistent: int = 0,
) -> int:
    """Collective calls one rank issues in one optimizer step: every collective of every phase
    of `step_parts` on every bucket, except those over a group of one (the engine skips them),
    plus one norm all-reduce per norm group of more than one rank. On CPU ranks each call costs
    a fixed host time whatever its size, which is why fetch groups exist (units.fetch_groups)."""
    parts = step_parts(
        s,
        padded_numels,
        shapes,
        hier,
        micro_batches=micro_batches,
        param_bytes=1,
        accum_bytes=1,
        zeropp=zeropp,
        reused=reused,
        persistent=persistent,
    )
    calls = sum(part.times * part.calls_once(shapes) for part in parts.values())
    return calls + sum(1 for g in norm_shapes(s, shapes, extra_norm_groups) if g.size > 1)


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


def qgz_exact_widths(
    seq: Sequence[Collective], shapes: DPShapes, padded: int, exact: Sequence[tuple[int, int]]
) -> list[int]:
    """fp32 values each peer's chunk carries besides its int4 codes, per qgZ stage.

    qgZ sends the tensors in `exact` (norm gains, biases: `BucketLayout.vector_ranges`)
    exactly: each chunk of a stage carries its values of them as fp32, padded to the most
    any chunk of that granularity in the bucket holds, so every peer's chunk has one size
    (the all-to-all needs equal splits) and the width needs no rank's position."""
    return [most_per_chunk(exact, padded, c.numel_div * getattr(shapes, c.group).size) for c in seq]


def most_per_chunk(ranges: Sequence[tuple[int, int]], numel: int, parts: int) -> int:
    """The most elements of `ranges` that any of `parts` equal chunks of `numel` holds."""
    return max((sum(b - a for a, b in piece) for piece in chunk_ranges(ranges, numel, parts)), default=0)


def qwz_exact_sides(
    seq: Sequence[Collective],
    shapes: DPShapes,
    padded: int,
    p_div: int,
    exact: Sequence[tuple[int, int]],
    param_bytes: int,
) -> tuple[int, ...]:
    """Bytes each peer's chunk carries besides its int8 codes, per collective of qwZ's gather.

    qwZ sends the tensors in `exact` exactly, like qgZ: each of the `p_div` p-level shards
    carries its values of them in the model dtype, padded to the most any shard holds
    (`most_per_chunk`), and a peer's chunk in a gather stage is whole shards."""
    width = most_per_chunk(exact, padded, p_div) * param_bytes
    return tuple(p_div // (c.numel_div * getattr(shapes, c.group).size) * width for c in seq)
