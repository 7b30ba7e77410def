"""Quantized data written before the two-addition rounding (kernels/format.py, ROUND_MAGIC)
decodes and continues unchanged.

`tests/data/loco_buffers_v1.pt` was written at commit fe06b5f, when codes were rounded with
`torch.round(...).clamp(-qmax, qmax)`: three LoCo steps (err_beta 0.8, int4, block 256) over a
819-value gradient spanning six decades with exact ties, the error buffer saved, then one more
step of `loco_quantize` and one of `dequant_reduce_loco_quantize` (2 int4 parts into the
buffer's first 3 blocks), their codes, scales and updated buffers saved. The engine keeps these
buffers in its checkpoints as plain fp32 tensors, so a run resumed after the change continues
from such a buffer: the step taken now must give the same codes and scales bit for bit and
the same buffer values (`torch.equal`; only the sign of a zero may differ, which equality
ignores and no later step can see, since zero is added). The Triton kernels and the compiled
CPU path equal the reference bit for bit (tests/test_kernels_triton.py,
tests/test_kernels_cpu_compiled.py), so they continue likewise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.format import QMAX, ROUND_MAGIC, TINY_ABSMAX

FIXTURE = Path(__file__).resolve().parent / "data" / "loco_buffers_v1.pt"


def test_loco_buffers_written_before_continue_bit_for_bit():
    old = torch.load(FIXTURE)
    block, beta = old["block_size"], old["err_beta"]
    err = old["err"].clone()
    codes, scales, err = reference.loco_quantize(old["grad"], err, beta, block)
    assert torch.equal(codes, old["codes"]) and torch.equal(scales, old["scales"])
    assert torch.equal(err, old["err_after"])
    err = old["reduce_err"].clone()
    codes, scales, err = reference.dequant_reduce_loco_quantize(
        old["parts_codes"], old["parts_scales"], 4, block, err, beta
    )
    assert torch.equal(codes, old["reduce_codes"]) and torch.equal(scales, old["reduce_scales"])
    assert torch.equal(err, old["reduce_err_after"])


def _old_codes(tile: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes as fe06b5f computed them: the same reciprocal, then torch.round and a clamp."""
    qmax = torch.tensor(float(QMAX[bits]))
    absmax = tile.abs().amax(dim=1)
    live = absmax >= TINY_ABSMAX
    inv = torch.where(live, qmax / torch.where(live, absmax, torch.ones_like(absmax)), torch.zeros_like(absmax))
    return torch.round(tile * inv[:, None]).clamp(-qmax, qmax)


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_equal_the_previous_rounding(bits):
    """Rows whose reciprocal is exact (absmax = qmax) holding every quarter in [-qmax, qmax],
    so every tie; rows of random values over six decades; a zero and a below-TINY row."""
    qmax = QMAX[bits]
    quarters = torch.arange(-4 * qmax, 4 * qmax + 1, dtype=torch.float32) / 4
    g = torch.Generator().manual_seed(bits)
    random = torch.randn(512, quarters.numel(), generator=g) * torch.logspace(-3, 3, 512)[:, None]
    tile = torch.cat([quarters[None], -quarters[None], random, torch.zeros(1, quarters.numel())])
    tile[-1, 0] = TINY_ABSMAX / 2
    codes, _ = reference.quantize_tile(tile, bits)
    assert torch.equal(codes, _old_codes(tile, bits))
    assert codes.abs().max() == qmax


def test_two_additions_round_half_to_even_up_to_2_to_22():
    """The identity itself, where it is claimed: every half-integer tie and random values."""
    ties = torch.arange(-(2**22), 2**22, 4099, dtype=torch.float32) + 0.5
    noise = (torch.rand(2**16, generator=torch.Generator().manual_seed(1)) * 2 - 1) * 2**22
    for t in (ties, noise, noise / 2**15):
        assert torch.equal((t + ROUND_MAGIC) - ROUND_MAGIC, torch.round(t))
