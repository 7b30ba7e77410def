"""What a collective puts on the links, per backend: the one formula the comm counter records
and the ZeRO traffic formulas (and through them the planner) price.

Why per backend: the volume model of the ZeRO papers (every member receives its share from
every other member, an all-reduce twice an all-gather) says nothing about which link a byte
crosses. gloo runs its all-reduce and all-gather as rings in group-rank order and has no
reduce-scatter of its own (it all-reduces the whole buffer, or the engine does so in place:
`comm.reduce_scatter_parts`), so on gloo the volume model both over-counts the inter-node link
(a ring crosses it only where consecutive members sit on different nodes) and under-counts a
reduce-scatter by half. Measured on netlab (docs/arch/parallel.md) the difference was up to
1.8x on a ZeRO-3 step; with this model counted equals the kernel's byte counters.

Models:
- "gloo": all_gather, all_reduce and reduce_scatter are rings over the group in group-rank
  order (gloo's ring all-gather; its ring all-reduce, of the whole buffer for a
  reduce-scatter). Every hop of a ring carries the same bytes, h: (k-1) chunks for an
  all-gather, 2 (k-1) chunks for an all-reduce of k chunks. Which member receives which hop
  depends on the member's position, so each member counts an equal share of the ring's k hops:
  h x crossings / k inter-node and h x (k - crossings) / k intra-node, where `crossings` is
  how many hops join members on different nodes. Summed over the group (or over a node, for
  the usual layouts where a node's members are consecutive) that is exactly what the links
  carry, and the count is the same on every member, so formulas need no rank position.
  all_to_all is a direct pairwise exchange (wire = volume model); a broadcast is a binomial
  tree from the root (`broadcast_parent`).
- any other backend (NCCL): the volume model. NCCL picks rings and trees at run time from the
  hardware topology, so no static formula is honest per link; the volume model is what
  NCCL's algorithms move per rank in total, and it has not been checked against a wire here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RING_BACKENDS = ("gloo",)
RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class GroupShape:
    """Members of a communication group as seen from one rank: how many peers share its node,
    how many hops of a ring in group-rank order cross nodes, and the backend that moves them."""

    size: int
    intra_peers: int
    inter_peers: int
    crossings: int = 0  # hops i -> i+1 (mod size) joining members on different nodes
    backend: str = "nccl"

    @staticmethod
    def of(ranks: Sequence[int], me: int, ranks_per_node: int, backend: str = "nccl") -> GroupShape:
        node = me // ranks_per_node
        intra = sum(1 for r in ranks if r != me and r // ranks_per_node == node)
        k = len(ranks)
        crossings = sum(1 for i in range(k) if ranks[i] // ranks_per_node != ranks[(i + 1) % k] // ranks_per_node)
        return GroupShape(k, intra, k - 1 - intra, crossings if k > 1 else 0, backend)

    @property
    def ring(self) -> bool:
        return self.backend in RING_BACKENDS


def _ring_share(hop: int, g: GroupShape) -> tuple[int, int]:
    """(intra, inter): one member's equal share of a ring whose k hops each carry `hop` bytes."""
    return hop * (g.size - g.crossings) // g.size, hop * g.crossings // g.size


def chunk_bytes(op: str, g: GroupShape, chunk: int) -> tuple[int, int]:
    """(intra, inter) bytes one member is counted for an all_gather (`chunk`: each member's
    input), reduce_scatter (`chunk`: each member's output) or all_to_all (`chunk`: each
    member's slice of the output) over `g`."""
    if g.size == 1:
        return 0, 0
    if g.ring and op in RING_OPS:
        per_hop = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2}[op]
        return _ring_share(per_hop * (g.size - 1) * chunk, g)
    return chunk * g.intra_peers, chunk * g.inter_peers


def all_reduce_bytes(nbytes: int, g: GroupShape) -> tuple[int, int]:
    """(intra, inter) bytes one member is counted for an all-reduce of `nbytes` over `g`."""
    if g.size == 1:
        return 0, 0
    if g.ring:  # each hop: 2 (k-1) chunks of nbytes / k; integer division after the product
        share_intra = 2 * (g.size - 1) * nbytes * (g.size - g.crossings) // (g.size * g.size)
        return share_intra, 2 * (g.size - 1) * nbytes * g.crossings // (g.size * g.size)
    return 2 * nbytes * g.intra_peers // g.size, 2 * nbytes * g.inter_peers // g.size


def broadcast_parent(member: int, root: int, size: int) -> int:
    """The group member a non-root `member` receives a gloo broadcast from: its parent in the
    binomial tree rooted at `root` (position v = member - root mod size; parent: v without its
    highest set bit)."""
    v = (member - root) % size
    return (v - (1 << (v.bit_length() - 1)) + root) % size
