"""Seconds for a collective and for compute: the planner's whole performance model.

Why this simple form: step times at cluster scale are dominated by bandwidth (bytes over the
slower of the two links) and, for many small buckets, by per-call latency; both are
first-order terms a user can check by hand. The bytes come from `megazpp.zero.formulas`.

A collective over a group of g ranks takes

    latency x (g - 1) ring steps (x 2 for an all-reduce)
    + max(intra bytes / intra bandwidth, inter bytes / inter bandwidth per rank)

where the bytes are what this rank receives by the comm counter's convention, the latency is
the inter-node one when any member sits on another node, and the inter-node bandwidth per rank
is the node's bandwidth shared by its ranks. Intra and inter transfers of one collective run
concurrently, so the slower link sets the time. On gloo, reduce-scatter is a full ring
all-reduce on the wire (docs/arch/parallel.md), so its bytes count twice.
"""

from __future__ import annotations

from megazpp.planner.cluster import Cluster
from megazpp.zero import formulas


def link_time(intra: float, inter: float, cluster: Cluster) -> float:
    """Seconds to receive `intra` and `inter` bytes over the two links at once."""
    return max(intra / cluster.intra_bw, inter / cluster.inter_bw_per_rank)


def collective_time(c: formulas.Collective, numel: int, elem: formulas.ElemFormat,
                    shapes: formulas.DPShapes, cluster: Cluster) -> tuple[int, int, float]:
    """(intra bytes, inter bytes, seconds) of one call of collective `c` on `numel` elements."""
    intra, inter = formulas.collective_bytes(c, numel, elem, shapes)
    group: formulas.GroupShape = getattr(shapes, c.group)
    if group.size == 1:
        return 0, 0, 0.0
    wire = 2 if cluster.backend == "gloo" and c.op == "reduce_scatter" else 1
    steps = (group.size - 1) * (2 if c.op == "all_reduce" else 1)
    latency = cluster.inter_latency if group.inter_peers else cluster.intra_latency
    return intra, inter, steps * latency + link_time(wire * intra, wire * inter, cluster)


def group_all_reduce_time(nbytes: float, group: formulas.GroupShape, cluster: Cluster) -> float:
    """A ring all-reduce of `nbytes` over `group` (tensor-parallel activations, norm scalars)."""
    if group.size == 1:
        return 0.0
    latency = cluster.inter_latency if group.inter_peers else cluster.intra_latency
    intra = 2 * nbytes * group.intra_peers / group.size
    inter = 2 * nbytes * group.inter_peers / group.size
    return 2 * (group.size - 1) * latency + link_time(intra, inter, cluster)
