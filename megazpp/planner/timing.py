"""Seconds for a collective and for compute: the planner's whole performance model.

Why this simple form: step times at cluster scale are dominated by bandwidth (bytes over the
slower of the two links) and, for many small buckets, by per-call latency; both are
first-order terms a user can check by hand. The bytes come from `megazpp.zero.traffic`.

A collective over a group of g ranks takes

    latency x (g - 1) ring steps (x 2 for an all-reduce)
    + max(intra bytes / intra bandwidth, inter bytes / inter bandwidth per rank)

where the bytes are what the comm counter records for this rank (`megazpp.parallel.wire`: on
gloo an equal share of each ring's hops, a reduce-scatter being the all-reduce gloo runs, so
the bytes are already those on the wire), the latency is the inter-node one when any member
sits on another node, and the inter-node bandwidth per rank is the node's bandwidth shared by
its ranks (the node's ranks' shares add up to what its link carries). Intra and inter
transfers of one collective run concurrently, so the slower link sets the time. Where the
collectives cost host time (gloo on CPU cores shared by several ranks, as in the netlab
calibration: a 4-rank all-gather of 4 KB took 2.9 ms, twice what the ring-step latency of a
2-rank all-reduce predicts, and gloo's all-gather received 0.6 GB/s where its all-reduce
reached 1 GB/s), a probe times each op on each group at three message sizes instead
(`probe_collectives`, `Cluster.collective_times`), and a call's time is read off those points
at its received bytes (intra + inter), piecewise linear.
"""

from __future__ import annotations

from collections.abc import Sequence

from megazpp.parallel import wire
from megazpp.parallel.wire import GroupShape
from megazpp.planner.cluster import Cluster
from megazpp.zero import sequences, traffic


def link_time(intra: float, inter: float, cluster: Cluster) -> float:
    """Seconds to receive `intra` and `inter` bytes over the two links: at once, or one after
    the other where the same CPU cores move both (`Cluster.overlap` false)."""
    times = (intra / cluster.intra_bw, inter / cluster.inter_bw_per_rank)
    return max(times) if cluster.overlap else sum(times)


def _ring_passes(c: sequences.Collective, cluster: Cluster) -> int:
    """Passes around the ring: 2 for an all-reduce and for gloo's reduce-scatter (it runs one)."""
    return 2 if c.op == "all_reduce" or (cluster.backend == "gloo" and c.op == "reduce_scatter") else 1


def _probed(c: sequences.Collective, cluster: Cluster) -> Sequence[tuple[float, float]] | None:
    return (cluster.collective_times or {}).get(f"{c.op}/{c.group}")


def _call_time(c: sequences.Collective, group: GroupShape, cluster: Cluster) -> float:
    """Seconds a call costs besides its bytes: the probed smallest message's time, else the
    latency of each ring step (an all-reduce, and gloo's reduce-scatter, take twice the steps)."""
    points = _probed(c, cluster)
    if points:
        return points[0][1]
    steps = (group.size - 1) * _ring_passes(c, cluster)
    return steps * (cluster.inter_latency if group.inter_peers else cluster.intra_latency)


def collective_time(
    c: sequences.Collective, numel: int, elem: traffic.ElemFormat, shapes: sequences.DPShapes, cluster: Cluster
) -> tuple[int, int, float]:
    """(intra bytes, inter bytes, seconds) of one call of collective `c` on `numel` elements."""
    intra, inter = traffic.collective_bytes(c, numel, elem, shapes)
    group: GroupShape = getattr(shapes, c.group)
    if group.size == 1:
        return 0, 0, 0.0
    points = _probed(c, cluster)
    if points:  # measured on this op and group
        return intra, inter, measured_time(points, intra + inter)
    return intra, inter, _call_time(c, group, cluster) + link_time(intra, inter, cluster)


def measured_time(points: Sequence[tuple[float, float]], received: float) -> float:
    """Seconds of a call receiving `received` bytes, piecewise linear through the probed
    (bytes, seconds) points: no less than the smallest message's time, and past the largest
    along the last segment."""
    if received <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if received <= b1:
            return t0 + (t1 - t0) * (received - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (received - b1) / (b1 - b0)


def host_time(
    c: sequences.Collective, intra: int, inter: int, seconds: float, shapes: sequences.DPShapes, cluster: Cluster
) -> float:
    """Of a collective's `seconds`, the part the host's own cores are busy with: the call itself
    plus every byte at the intra-node rate, the fastest the cores move bytes; the remainder is
    waiting on a slower link."""
    call = _call_time(c, getattr(shapes, c.group), cluster)
    return min(seconds, call + (intra + inter) / cluster.intra_bw)


def group_all_reduce_time(nbytes: float, group: GroupShape, cluster: Cluster) -> float:
    """A ring all-reduce of `nbytes` over `group` (tensor-parallel activations, norm scalars)."""
    if group.size == 1:
        return 0.0
    latency = cluster.inter_latency if group.inter_peers else cluster.intra_latency
    return 2 * (group.size - 1) * latency + link_time(*wire.all_reduce_bytes(round(nbytes), group), cluster)
