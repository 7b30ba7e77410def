"""LoCo on a least-squares problem with 4-bit gradients, in one process.

qgZ's two int4 stages are simulated with the kernels on 4 virtual ranks (2 nodes x 2), laid
out exactly as the engine does (`megazpp.zero.quantized`): stage 1 quantizes a rank's whole
gradient and each local peer j reduces chunk j of the bucket; stage 2 re-quantizes that sum
and each node n reduces its piece. LoCo keeps one error buffer per rank and stage. Gradient
descent with a fixed step on the averaged gradient: plain 4-bit gradients stall at an error
floor set by the quantization error, LoCo's error feedback cancels most of it, so the final
excess loss with LoCo must be at most half of the excess loss without it.
"""

from __future__ import annotations

import torch

import kernels

NODES, LOCAL = 2, 2
RANKS = NODES * LOCAL
DIM, ROWS, BLOCK, STEPS, LR = 256, 512, 32, 300, 1.0
ERR_BETA = 0.8  # DeepSpeed's documented default for zeropp_loco_param.err_beta


def _problem() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, float]:
    g = torch.Generator().manual_seed(0)
    A = [torch.randn(ROWS, DIM, generator=g) * torch.logspace(0, -1, DIM) for _ in range(RANKS)]
    b = [torch.randn(ROWS, generator=g) for _ in range(RANKS)]
    x_star = torch.linalg.lstsq(torch.cat(A), torch.cat(b)).solution
    return A, b, x_star, _loss(A, b, x_star)


def _loss(A: list[torch.Tensor], b: list[torch.Tensor], x: torch.Tensor) -> float:
    return float(sum(((a @ x - y) ** 2).sum() for a, y in zip(A, b)) / (2 * RANKS * ROWS))


def _qgz(grads: torch.Tensor, loco: list[list[torch.Tensor]] | None) -> torch.Tensor:
    """Sum over ranks of `grads` [RANKS, DIM] through two int4 all-to-all stages."""
    chunk, piece = DIM // LOCAL, DIM // RANKS
    sent = []
    for r in range(RANKS):
        if loco:
            codes, scales, _ = kernels.loco_quantize(grads[r], loco[r][0], ERR_BETA, BLOCK, bits=4)
        else:
            codes, scales = kernels.quantize(grads[r], 4, BLOCK)
        sent.append((codes.view(LOCAL, -1), scales.view(LOCAL, -1)))
    node_sums = {}
    for n in range(NODES):
        for j in range(LOCAL):
            peers = [n * LOCAL + i for i in range(LOCAL)]
            codes = torch.stack([sent[p][0][j] for p in peers])
            scales = torch.stack([sent[p][1][j] for p in peers])
            if loco:
                q, s, _ = kernels.dequant_reduce_loco_quantize(codes, scales, 4, BLOCK,
                                                               loco[n * LOCAL + j][1], ERR_BETA)
            else:
                q, s = kernels.dequant_reduce_quantize(codes, scales, 4, BLOCK)
            node_sums[n, j] = (q.view(NODES, -1), s.view(NODES, -1))
    total = torch.empty(DIM)
    for j in range(LOCAL):
        for n in range(NODES):  # the rank at (node n, local j) receives piece n of chunk j from each node
            codes = torch.stack([node_sums[m, j][0][n] for m in range(NODES)])
            scales = torch.stack([node_sums[m, j][1][n] for m in range(NODES)])
            lo = j * chunk + n * piece
            total[lo:lo + piece] = kernels.dequant_reduce(codes, scales, 4, BLOCK)
    return total


def _train(loco_on: bool) -> list[float]:
    A, b, x_star, best = _problem()
    x = torch.zeros(DIM)
    loco = ([[kernels.new_error_buffer(DIM, BLOCK), kernels.new_error_buffer(DIM // LOCAL, BLOCK)]
             for _ in range(RANKS)] if loco_on else None)
    excess = []
    for _ in range(STEPS):
        grads = torch.stack([a.T @ (a @ x - y) / ROWS for a, y in zip(A, b)])
        x = x - LR * _qgz(grads, loco) / RANKS
        excess.append(_loss(A, b, x) - best)
    return excess


def test_loco_halves_the_excess_loss_of_4bit_gradients():
    exact_grads = torch.randn(RANKS, DIM, generator=torch.Generator().manual_seed(1))
    assert (_qgz(exact_grads, None) - exact_grads.sum(0)).abs().max() > 0  # really quantized
    plain, loco = _train(False), _train(True)
    final_plain = sum(plain[-20:]) / 20
    final_loco = sum(loco[-20:]) / 20
    print(f"excess loss over the last 20 of {STEPS} steps: 4-bit {final_plain:.3e}, LoCo {final_loco:.3e}")
    assert final_plain > 0
    assert final_loco <= 0.5 * final_plain, (final_loco, final_plain)
