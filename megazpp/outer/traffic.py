"""Bytes and calls of the outer synchronisation (DiLoCo) across islands, by comm's convention.

Why a formula of its own: the planner prices two-level training and the tests assert the
counter against it, so both read the same function (as `zero.traffic` is for the inner step).

One outer sync of a fragment is, on every rank, over its peer group (the rank holding the same
shard in every island, one per island):
1. an all-to-all of the pseudo-gradient in the wire format (chunk j goes to peer j),
2. each rank averages the chunks it received, in fp32,
3. an all-gather of the averaged chunk, in the wire format.
So every wire format costs what an all-reduce of its bytes costs (2 (I-1)/I of the payload per
rank), the average is taken in fp32 whatever the format, and every island ends with the same
bits. Wire formats (`QUANTIZE`): fp32 ("none"), bf16, or int4 codes plus one fp32 scale per
`block` values (the qgZ format, `zero.zeropp.QuantFormat`). The fragment is padded to a
multiple of I (x `block` for int4) so that every chunk has one size and whole blocks.

Islands are made of whole nodes, so every member of a peer group is on another node: all the
bytes are inter-node.

These are the bytes of the islands' phase: with `outer.start_iter` S the steps before S are a
synchronous job's over all DP ranks (`zero.traffic.step_bytes` of its engine), and the one-time
gather of the synchronous engine's state at S (`training/start_iter.py`) is counted apart from
any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megazpp.outer.settings import QUANTIZE
from megazpp.parallel.wire import GroupShape, all_reduce_bytes
from megazpp.zero.zeropp import QuantFormat

DEFAULT_BLOCK = 256  # values per fp32 scale of the int4 format (as qgZ's default)
SYNC_CALLS = 2  # collectives per fragment sync: the all-to-all and the all-gather
STATS_BYTES = 8  # the fp32 pair summed for logging: squared norms of the mean and own pseudo-gradient


def wire_format(quantize: str, block: int = DEFAULT_BLOCK) -> int | QuantFormat:
    """Bytes per element of a plain wire dtype, or the int4 block format."""
    if quantize == "none":
        return 4
    if quantize == "bf16":
        return 2
    if quantize == "int4":
        return QuantFormat(4, block)
    raise ValueError(f"outer quantize {quantize!r}: expected one of {', '.join(QUANTIZE)}")


def padded_numel(numel: int, islands: int, quantize: str, block: int = DEFAULT_BLOCK) -> int:
    """`numel` rounded up to what one fragment sync moves: a multiple of `islands` chunks,
    each whole blocks under int4."""
    unit = islands * (block if quantize == "int4" else 1)
    return -(-numel // unit) * unit


def wire_bytes(numel: int, quantize: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of `numel` (whole blocks under int4) values in the wire format."""
    fmt = wire_format(quantize, block)
    return fmt.nbytes(numel) if isinstance(fmt, QuantFormat) else numel * fmt


def exchange_bytes(numel: int, islands: int, quantize: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes one fragment's exchange (`megazpp.outer.exchange.Exchange`) holds at its largest,
    while its all-to-all runs: the fp32 pseudo-gradient padded, the buffer sent in the wire
    format (under fp32 the pseudo-gradient itself), the one received and the gathered result.
    The memory one sync adds to the outer state, per fragment in flight (`DiLoCoEngine`)."""
    n = padded_numel(numel, islands, quantize, block)
    wire = wire_bytes(n, quantize, block)
    return 4 * n + (0 if quantize == "none" else wire) + 2 * wire


def error_buffer_bytes(numel: int, islands: int, block: int = DEFAULT_BLOCK) -> int:
    """int4's error feedback of one fragment of `numel` elements: fp32 buffers of what the wire
    dropped of the padded pseudo-gradient and of the one averaged chunk the rank owns."""
    n = padded_numel(numel, islands, "int4", block)
    return 4 * (n + n // islands)


# fp32 vectors of one fragment alive at once while it lands: the islands' mean and a scratch
# (the weighted squares for logging, then the Nesterov step's sum)
LANDING_FP32_VECTORS = 2


def sync_peak_bytes(numel: int, islands: int, quantize: str, block: int = DEFAULT_BLOCK) -> int:
    """What one fragment's sync adds on top of the outer state at its peak (one exchange in
    flight): the exchange's buffers at their largest and the landing's fp32 vectors."""
    return exchange_bytes(numel, islands, quantize, block) + LANDING_FP32_VECTORS * 4 * numel


def sync_bytes(numel: int, islands: int, quantize: str, block: int = DEFAULT_BLOCK) -> tuple[int, int]:
    """(intra, inter) bytes one rank receives in one outer sync of a fragment of `numel` fp32
    elements of its shard, over `islands` islands."""
    if islands < 2:
        return 0, 0
    n = padded_numel(numel, islands, quantize, block)
    fmt = wire_format(quantize, block)
    chunk = n // islands
    per_peer = fmt.nbytes(chunk) if isinstance(fmt, QuantFormat) else chunk * fmt
    return 0, 2 * (islands - 1) * per_peer  # all-to-all + all-gather, one chunk from each peer each


def moment_wire(quantize: str) -> str:
    """The wire the inner optimizer's moments cross islands in (`outer.optimizer_state_every`): fp32
    under fp32 outer gradients, else bf16. Never int4: a block of the second moment (positive,
    heavy-tailed: its values span orders of magnitude) shares one absmax scale, so most of it
    would round to 0 or to a level far from it, and AdamW divides by its square root; and no
    error feedback can carry what was dropped, since the averaged moments replace the islands'
    own. bf16 keeps fp32's range and a relative 2^-9 of each value, positive stays positive."""
    return "none" if quantize == "none" else "bf16"


def moment_sync_bytes(numel: int, islands: int, quantize: str) -> tuple[int, int]:
    """(intra, inter) bytes one rank receives averaging one moment (a state tensor of the inner
    optimizer) of a fragment of `numel` elements of its shard: an exchange as the pseudo-
    gradient's, in `moment_wire`, `SYNC_CALLS` calls."""
    return sync_bytes(numel, islands, moment_wire(quantize))


def moment_peak_bytes(numel: int, islands: int, quantize: str) -> int:
    """What averaging one moment of a fragment adds at its peak: its exchange's buffers at their
    largest and the fp32 mean written back (`megazpp.outer.moments`)."""
    return exchange_bytes(numel, islands, moment_wire(quantize)) + 4 * numel


def sync_calls(islands: int) -> int:
    """Collective calls one rank issues in one outer sync of one fragment."""
    return SYNC_CALLS if islands > 1 else 0


@dataclass(frozen=True)
class OuterTraffic:
    """What the outer syncs cost one rank, per inner step: `mean_*` averaged over an interval
    of H inner steps, `peak_inter` the most any single inner step moves (one fragment's sync;
    with F fragments at staggered steps, about 1/F of the whole shard's)."""

    mean_intra: float
    mean_inter: float
    peak_inter: int
    calls_per_interval: float  # moments averaged every k-th sync count 1 / k of theirs


def fragment_runs(tensors: int, fragments: int) -> list[range]:
    """The parameter tensors (by position in bucket order) of each of `fragments` fragments:
    runs as even in count as they divide. The one cut the runtime syncs and the planner
    prices: a fragment is the same tensors on every rank of a peer group."""
    return [range(f * tensors // fragments, (f + 1) * tensors // fragments) for f in range(fragments)]


def per_step(
    fragment_numels: Sequence[int],
    islands: int,
    quantize: str,
    sync_every: int,
    block: int = DEFAULT_BLOCK,
    moment_every: Sequence[int] = (),
) -> OuterTraffic:
    """The outer traffic of one rank amortised over `sync_every` (H) inner steps: every
    fragment (its shard's elements in `fragment_numels`) is synced once per H steps, at its own
    step, staggered by H / F, so no two fragments share an inner step when F <= H (else the
    peak is that of the most fragments due at one step). `moment_every`: for each moment of
    the inner optimizer averaged across islands, every how many of a fragment's syncs (k >= 1;
    `outer.optimizer_state_every` per state tensor); the peak step is a sync where all of them fall together.
    `sync_every` is a checked one (`settings.OuterOptions` refuses H < 1, naming the key)."""
    each = [sync_bytes(n, islands, quantize, block) for n in fragment_numels]
    moments = [moment_sync_bytes(n, islands, quantize) for n in fragment_numels]
    intra = sum(a for a, _ in each) + sum(a / k for a, _ in moments for k in moment_every)
    inter = sum(b for _, b in each) + sum(b / k for _, b in moments for k in moment_every)
    at_step: dict[int, int] = {}
    for f, ((_, b), (_, m)) in enumerate(zip(each, moments)):
        step = f * sync_every // len(each)
        at_step[step] = at_step.get(step, 0) + b + m * len(moment_every)
    return OuterTraffic(
        intra / sync_every,
        inter / sync_every,
        max(at_step.values(), default=0),
        sync_calls(islands) * len(fragment_numels) * (1 + sum(1 / k for k in moment_every)),
    )


def stats_bytes(world: GroupShape) -> tuple[int, int]:
    """(intra, inter) bytes of the logging sum taken at an inner step where fragments synced:
    one all-reduce of `STATS_BYTES` over the world group (`world` as seen from this rank)."""
    return all_reduce_bytes(STATS_BYTES, world)
