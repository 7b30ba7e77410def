"""Which positions of the job's global sample order each elastic island reads (docs/arch/elastic.md).

Why a plan laid out at the syncs and not a position per island: islands come and go, so a
place in the data that follows from an island's own step count would let two islands started
alike read the same samples, and would lose the samples of an island that died. Here every
island of a quorum holds the same plan (it changes only at a committed exchange, from what every
island of that exchange gathered, and a healing island takes it with the live state): the
first position no island has claimed, the ranges given back (`pending`), and each island's claim
for the interval after the exchange. At the next exchange a claim counts as trained when its
island is in the quorum with tokens (its interval is merged); any other claim (its island died,
or it healed, or it had just started and trained none of it) is re-queued and claimed first by
the next layout, so no sample is merged twice and none is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from megazpp.outer.fragments import merge_ranges

Range = tuple[int, int]  # positions [lo, hi) of the global sample order


class PlanState(TypedDict):
    """`DataPlan` as plain values (a checkpoint's, or the live state's)."""

    next: int
    pending: list[list[int]]
    claims: dict[str, list[list[int]]]  # island id (as text) -> its ranges


def ranges_text(ranges: Sequence[Range]) -> str:
    """`[0, 16)+[40, 48)`: how the log names a claim (tests parse it)."""
    return "+".join(f"[{lo}, {hi})" for lo, hi in ranges) or "none"


@dataclass
class DataPlan:
    """The job's place in the global sample order, as the last committed exchange left it."""

    next: int = 0  # the first position no island has claimed
    pending: list[Range] = field(default_factory=list)  # re-queued, claimed first, oldest first
    claims: dict[int, list[Range]] = field(default_factory=dict)  # island id -> its interval's ranges

    def lay_out(self, islands: Sequence[int], tokens: Sequence[int], wants: Sequence[int], where: str) -> list[str]:
        """The exchange `where` (its name in the log) committed with `islands` (quorum order),
        each having trained `tokens` since the last one and asking `wants` positions for its
        next interval: re-queue the claims not merged, then claim for each island in quorum
        order, re-queued ranges first. Returns the log lines (every island logs the same)."""
        lines = []
        trained = {i for i, n in zip(islands, tokens) if n > 0}
        for island in sorted(self.claims):
            if island in trained or not self.claims[island]:
                continue
            why = "its island was absent" if island not in islands else "its island trained none of it since"
            lines.append(
                f"outer: samples {ranges_text(self.claims[island])} of island {island}'s claim were not merged at "
                f"{where} ({why}): re-queued"
            )
            self.pending.extend(self.claims[island])
        self.claims = {island: self._take(n) for island, n in zip(islands, wants)}
        laid = ", ".join(f"island {i} {ranges_text(self.claims[i])}" for i in islands)
        lines.append(f"outer: samples claimed after {where}: {laid}")
        return lines

    def _take(self, n: int) -> list[Range]:
        """`n` positions: the oldest re-queued ranges first, then unclaimed ones."""
        out: list[Range] = []
        while n and self.pending:
            lo, hi = self.pending[0]
            k = min(n, hi - lo)
            out.append((lo, lo + k))
            n -= k
            if lo + k == hi:
                self.pending.pop(0)
            else:
                self.pending[0] = (lo + k, hi)
        if n:
            out.append((self.next, self.next + n))
            self.next += n
        return merge_ranges(out)

    def positions(self, island: int, start: int, count: int) -> list[int] | None:
        """Positions `start` .. `start + count` of `island`'s claim, in order; None when its
        claim is shorter."""
        out: list[int] = []
        for lo, hi in self.claims.get(island, []):
            if start >= hi - lo:
                start -= hi - lo
                continue
            take = min(count - len(out), hi - lo - start)
            out.extend(range(lo + start, lo + start + take))
            start = 0
            if len(out) == count:
                return out
        return None

    def state(self) -> PlanState:
        """A copy as plain values."""
        return {
            "next": self.next,
            "pending": [list(r) for r in self.pending],
            "claims": {str(i): [list(r) for r in rs] for i, rs in self.claims.items()},
        }

    @classmethod
    def from_state(cls, state: PlanState) -> DataPlan:
        return cls(
            int(state["next"]),
            [(int(lo), int(hi)) for lo, hi in state["pending"]],
            {int(i): [(int(lo), int(hi)) for lo, hi in rs] for i, rs in state["claims"].items()},
        )
