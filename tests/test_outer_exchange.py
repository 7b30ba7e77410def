"""One fragment's exchange and the int4 outer wire, for every chunk size a rank can hold of a
fragment: none (a fragment whose tensors lie in the other ranks' shards), one block, several,
and more than one encoding slice.

The int4 rows are checked against the wire format written out here with plain torch ops
(blocks of 256, absmax / 7 per block, codes rounded and clamped to [-7, 7], the error the
compensated value minus its decoded value): the same operations in the same order as the
kernels' reference, so compared exactly. Issue 36: a rank holding nothing of a fragment made a
[parts, 0] byte row, whose scales could not be viewed as fp32."""

from __future__ import annotations

import pytest
import torch

from megazpp.outer import exchange
from megazpp.outer.exchange import Exchange, Int4Wire, average_chunks, padded_size

BLOCK = 256
QMAX = 7.0


def _wire_format(compensated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded values, error left) of whole blocks of `compensated` on the int4 wire."""
    tile = compensated.view(-1, BLOCK)
    absmax = tile.abs().amax(dim=1)
    qmax = torch.tensor(QMAX)
    scale = torch.where(absmax > 0, absmax / qmax, torch.zeros_like(absmax))
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    codes = torch.round(tile * inv[:, None]).clamp_(-QMAX, QMAX)
    decoded = codes * scale[:, None]
    return decoded.reshape(-1), (tile - decoded).reshape(-1)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("blocks", [0, 1, 2, 5])
def test_int4_rows_round_trip_every_chunk_size(monkeypatch, parts, blocks):
    monkeypatch.setattr(exchange, "ENCODE_BLOCKS", 2)  # 5 blocks: slices of 2, 2 and 1 blocks
    wire = Int4Wire(BLOCK)
    g = torch.Generator().manual_seed(7 * parts + blocks)
    values = torch.randn(parts * blocks * BLOCK, generator=g)
    err = torch.randn(values.numel(), generator=g) * 0.01
    compensated = values + err
    rows = wire.encode(values, err, parts)
    assert rows.shape == (parts, blocks * BLOCK // 2 + blocks * 4) and rows.dtype == torch.uint8
    assert rows.shape[1] == wire.row_bytes(blocks * BLOCK)
    decoded = wire.decode(rows)
    want, left = _wire_format(compensated)
    assert decoded.shape == (parts, blocks * BLOCK) and decoded.dtype == torch.float32
    assert torch.equal(decoded.reshape(-1), want)
    assert torch.equal(err, left)  # the whole error is carried (no blending)


def test_int4_without_feedback_rounds_plainly():
    wire = Int4Wire(BLOCK, feedback=False)
    values = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(3))
    err = torch.full_like(values, 0.5)  # cleared before quantizing: not added
    decoded = wire.decode(wire.encode(values, err, 2))
    assert torch.equal(decoded.reshape(-1), _wire_format(values)[0])


@pytest.mark.parametrize("quantize", ["none", "bf16", "int4"])
@pytest.mark.parametrize("numel", [0, 1, 5, 300])
def test_exchange_of_one_island_is_its_pseudo_gradient_on_the_wire(quantize, numel):
    """Without a process group the peer group is this rank alone (`comm`'s world of one): the
    mean is the rank's own pseudo-gradient as the wire carries it, for any fragment size."""
    int4 = Int4Wire(BLOCK) if quantize == "int4" else None
    n = padded_size(numel, 1, quantize, int4)
    assert n == (-(-numel // BLOCK) * BLOCK if quantize == "int4" else numel)
    padded = torch.zeros(n)
    padded[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    errors = (torch.zeros(n), torch.zeros(n)) if int4 else None
    wire = {"none": torch.float32, "bf16": torch.bfloat16, "int4": torch.uint8}[quantize]
    x = Exchange.start(0, 1, padded, numel, 1, quantize, wire, None, int4, errors)
    x.advance(None)
    mean = x.mean(None)
    assert mean.shape == (numel,) and mean.dtype == torch.float32
    if quantize == "int4":
        # the rank quantizes its pseudo-gradient, then the average of the one chunk it received
        once, _ = _wire_format(padded)
        twice, _ = _wire_format(once)
        assert torch.equal(mean, twice[:numel])
    else:
        assert torch.equal(mean, average_chunks(padded.to(wire).view(1, -1)).to(wire).float()[:numel])
