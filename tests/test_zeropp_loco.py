"""LoCo on a least-squares problem with 4-bit gradients, through the engine's own qgZ path.

Four virtual DP ranks (2 nodes x 2) in one process, each with the objects a `ZeroEngine` builds
for strategy NGG with qgZ and two-stage reductions: its `ZeroPPPaths` (stage sequence from
`sequences.qgz_sequence`, LoCo buffers in `LocoState`) over its bucket (`BucketLayout`). Each
rank's gradient goes through `paths.start_grad_reduce` (`quantized.PendingQuantizedReduce`:
pack order, chunking, dequantize-sum, requantization), driven by the engine's progress point
(`StageOrder.progress`), and its reduced piece is placed where its layout says it owns it
(`shard_range(G)`). Only the transport is stood in for: `all_to_all_single` between the virtual
ranks' buffers, chunk i of a member's send to group member i, as torch.distributed defines it.
So a change to qgZ's layout in the engine is what this test runs, and a piece landing where
the layout does not say breaks both the direct check and the descent.

Gradient descent with a fixed step on the averaged gradient: plain 4-bit gradients stall at an
error floor set by the quantization error, LoCo's error feedback cancels most of it, so the
final excess loss with LoCo must be at most half of the excess loss without it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from megazpp.zero import quantized
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import ZeroGroups
from megazpp.zero.layout import BucketLayout
from megazpp.zero.sequences import dp_shapes
from megazpp.zero.strategy import Level, parse_strategy
from megazpp.zero.traffic import choose_hierarchy
from megazpp.zero.zeropp import ZeroPP
from megazpp.zero.zeropp_paths import ZeroPPPaths

NODES, LOCAL = 2, 2
RANKS = NODES * LOCAL
SIDE = 16
DIM, ROWS, BLOCK, STEPS, LR = SIDE * SIDE, 512, 32, 300, 1.0
ERR_BETA = 0.8  # DeepSpeed's documented default for zeropp_loco_param.err_beta


def _problem() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, float]:
    g = torch.Generator().manual_seed(0)
    A = [torch.randn(ROWS, DIM, generator=g) * torch.logspace(0, -1, DIM) for _ in range(RANKS)]
    b = [torch.randn(ROWS, generator=g) for _ in range(RANKS)]
    x_star = torch.linalg.lstsq(torch.cat(A), torch.cat(b)).solution
    return A, b, x_star, _loss(A, b, x_star)


def _loss(A: list[torch.Tensor], b: list[torch.Tensor], x: torch.Tensor) -> float:
    return float(sum(((a @ x - y) ** 2).sum() for a, y in zip(A, b)) / (2 * RANKS * ROWS))


class _Transport:
    """`comm.all_to_all_single` between virtual ranks. A group is (kind, members, my index);
    the n-th calls of a group's members form one collective, complete once all have sent."""

    def __init__(self) -> None:
        self._calls: dict[tuple, int] = defaultdict(int)
        self._posted: dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)

    def all_to_all_single(
        self, recv: torch.Tensor, send: torch.Tensor, *, group: tuple, async_op: bool, tag: str
    ) -> _Work:
        kind, members, me = group
        n = self._calls[kind, members, me]
        self._calls[kind, members, me] += 1
        posted = self._posted[kind, members, n]
        posted[me] = (send, recv)
        return _Work(posted, len(members), me)


class _Work:
    def __init__(self, posted: dict[int, tuple[torch.Tensor, torch.Tensor]], size: int, me: int) -> None:
        self._posted, self._size, self._me = posted, size, me

    def is_completed(self) -> bool:
        return len(self._posted) == self._size

    def wait(self) -> None:
        assert self.is_completed(), "waited before every member sent"
        recv = self._posted[self._me][1]
        recv.copy_(torch.cat([self._posted[m][0].view(self._size, -1)[self._me] for m in range(self._size)]))


def _groups(rank: int) -> ZeroGroups:
    """Virtual rank `rank`'s groups, members as `Topology.dp_subgroup` / `dp_cross_subgroup` order them."""
    node, local = divmod(rank, LOCAL)
    intra = tuple(node * LOCAL + i for i in range(LOCAL))
    cross = tuple(n * LOCAL + local for n in range(NODES))
    dp = tuple(range(RANKS))
    return ZeroGroups(
        ("dp", dp, rank),
        ("intra", intra, local),
        ("cross", cross, node),
        RANKS,
        LOCAL,
        later={"intra": ("intra-later", intra, local), "cross": ("cross-later", cross, node)},
    )


class _Rank:
    """What a ZeroEngine builds on DP rank `rank` for one 16 x 16 weight (2-D: all of it int4)."""

    def __init__(self, rank: int, loco: bool) -> None:
        strategy = parse_strategy("NGG")
        zeropp = ZeroPP(qgz=True, loco=loco, qgz_block=BLOCK, err_beta=ERR_BETA, reset_t=10 * STEPS)
        self.groups = _groups(rank)
        shapes = dp_shapes(range(RANKS), LOCAL, rank, LOCAL, backend="gloo")
        self.paths = ZeroPPPaths(strategy, self.groups, choose_hierarchy(shapes, "always"), shapes, zeropp, 0)
        weight = nn.Parameter(torch.zeros(SIDE, SIDE))
        layout = BucketLayout.build([("weight", weight)], RANKS, LOCAL, rank, zeropp.alignment())
        self.bucket = Bucket(
            "bucket0", layout, [], layout.flatten(torch.float32), torch.zeros(layout.shard_size(Level.G)), [], []
        )
        self.paths.init_bucket(self.bucket)


def _reduced(ranks: list[_Rank], grads: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of `grads` [RANKS, DIM] through the engine's qgZ reduction,
    assembled from each rank's reduced piece at its layout's G shard."""
    pending = []
    for r, rank in enumerate(ranks):
        staging = torch.zeros(rank.bucket.layout.padded)
        staging[:DIM] = grads[r] / RANKS  # the engine's 1/D pre-division (`_on_grad`)
        pending.append(rank.paths.start_grad_reduce(rank.bucket, staging))
    for rank in ranks:  # a progress point on each rank: stage 2 starts where stage 1 is done
        assert rank.groups.order.progress() == 1
    whole = torch.full((ranks[0].bucket.layout.padded,), float("nan"))
    for rank, p in zip(ranks, pending):
        lo, hi = rank.bucket.layout.shard_range(Level.G)
        whole[lo:hi] = p.wait()
    return whole[:DIM]


def _train(loco: bool) -> list[float]:
    A, b, x_star, best = _problem()
    ranks = [_Rank(r, loco) for r in range(RANKS)]
    assert [c.group for c in ranks[0].paths._qgz_seq] == ["intra", "cross"]  # two int4 stages
    x = torch.zeros(DIM)
    excess = []
    for step in range(1, STEPS + 1):
        grads = torch.stack([a.T @ (a @ x - y) / ROWS for a, y in zip(A, b)])
        x = x - LR * _reduced(ranks, grads)
        for rank in ranks:
            rank.paths.after_step(False, step, 1.0)  # a completed step, nothing clipped
        excess.append(_loss(A, b, x) - best)
    return excess


def test_loco_halves_the_excess_loss_of_4bit_gradients(monkeypatch):
    monkeypatch.setattr(quantized, "comm", _Transport())
    exact = torch.randn(RANKS, DIM, generator=torch.Generator().manual_seed(1))
    error = (_reduced([_Rank(r, False) for r in range(RANKS)], exact) - exact.mean(0)).abs().max().item()
    # really quantized, and every piece where the layout puts it: int4 with a per-block absmax
    # scale errs by at most half a step (absmax / 7 / 2) per quantization; stage 1 quantizes
    # each rank's grad / 4 (absmax <= m / 4, m = max |exact|), stage 2 each pair's sum
    # (<= m / 2), so the mean is off by at most 4 (m / 4) / 14 + 2 (m / 2) / 14 = m / 7
    assert 0 < error <= exact.abs().max().item() / 7
    plain, loco = _train(False), _train(True)
    final_plain = sum(plain[-20:]) / 20
    final_loco = sum(loco[-20:]) / 20
    print(f"excess loss over the last 20 of {STEPS} steps: 4-bit {final_plain:.3e}, LoCo {final_loco:.3e}")
    assert final_plain > 0
    assert final_loco <= 0.5 * final_plain, (final_loco, final_plain)
