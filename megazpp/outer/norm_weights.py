"""The weights behind the outer step's logged norms (`outer/pseudo_grad_norm`,
`outer/island_divergence`): which elements of the rank's flat os shard it counts, and by how much.

A rank counts the elements the engine counts in its norms (`ShardMap.norm_ranges`: TP-replicated
tensors on one TP rank), each weighing 1 / replication (how many ranks of an island hold the
same os shard), so summed over every rank of every island each element counts once per island.
"""

from __future__ import annotations

import torch

from megazpp.outer.fragments import Fragment
from megazpp.zero.shard_map import Range, ShardMap


class NormWeights:
    """The counted ranges of the flat shard and their weight, from one island's engine's map."""

    def __init__(self, shard: ShardMap) -> None:
        self.ranges: list[Range] = shard.norm_ranges
        # how many ranks of an island hold each os shard (os = N: all of them)
        self.replication = shard.replication

    def weighted_squares(self, frag: Fragment, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """sum(weight * values * values) over `frag`'s vector, the weight per element 1 /
        replication where this rank counts it in norms, else 0; written into `out` (a scratch of
        the fragment's size) run by run from scalars, with no weight vector: the same products,
        so the same sum, as a weight tensor would give."""
        pos, value = 0, 1.0 / self.replication
        for a, b in frag.ranges:
            cuts = sorted({a, b} | {min(max(x, a), b) for r in self.ranges for x in r})
            for lo, hi in zip(cuts, cuts[1:]):
                inside = any(n_lo <= lo and hi <= n_hi for n_lo, n_hi in self.ranges)
                torch.mul(
                    values[pos + lo - a : pos + hi - a], value if inside else 0.0, out=out[pos + lo - a : pos + hi - a]
                )
            pos += b - a
        return out.mul_(values).sum()
