"""The outer sync's byte formula (megazpp.outer.traffic) against hand-computed numbers."""

import pytest
import torch

from megazpp.outer import traffic
from megazpp.outer.exchange import Int4Wire
from megazpp.zero.sequences import GroupShape


def test_sync_bytes_per_format():
    # 2 islands, 1000 fp32 elements: chunk of 500 from the one peer, twice (all-to-all + all-gather)
    assert traffic.sync_bytes(1000, 2, "none") == (0, 2 * 500 * 4)
    assert traffic.sync_bytes(1000, 2, "bf16") == (0, 2 * 500 * 2)
    # int4, block 256: padded to 2 x 256 x 2 = 1024; chunk 512 = 256 code bytes + 2 scales
    assert traffic.padded_numel(1000, 2, "int4", 256) == 1024
    assert traffic.sync_bytes(1000, 2, "int4", 256) == (0, 2 * (256 + 2 * 4))
    # 4 islands, 10 elements padded to 12: 3 peers x chunk 3 x 4 bytes x 2 collectives
    assert traffic.sync_bytes(10, 4, "none") == (0, 2 * 3 * 3 * 4)
    assert traffic.sync_bytes(10, 1, "none") == (0, 0)
    assert traffic.sync_calls(4) == 2 and traffic.sync_calls(1) == 0


def test_int4_is_about_an_eighth_of_fp32():
    n = 1 << 20
    fp32 = traffic.sync_bytes(n, 8, "none")[1]
    int4 = traffic.sync_bytes(n, 8, "int4", 256)[1]
    assert int4 == fp32 // 8 + 2 * 7 * (n // 8 // 256) * 4


def test_per_step_amortises_and_staggers():
    frags = [100, 100, 100, 100]
    t = traffic.per_step(frags, 2, "none", sync_every=8)
    whole = 4 * traffic.sync_bytes(100, 2, "none")[1]
    assert t.mean_inter == whole / 8 and t.mean_intra == 0
    assert t.peak_inter == whole // 4  # one fragment per inner step
    assert t.calls_per_interval == 8
    crowded = traffic.per_step(frags, 2, "none", sync_every=2)  # 4 fragments, 2 steps: two at once
    assert crowded.peak_inter == whole // 2
    assert traffic.per_step([400], 2, "none", sync_every=8).peak_inter == whole


def test_moments_cross_in_fp32_or_bf16_and_amortise_over_their_period():
    # never int4: the second moment's blocks would lose most of their values (traffic.moment_wire)
    assert [traffic.moment_wire(q) for q in traffic.QUANTIZE] == ["none", "bf16", "bf16"]
    assert traffic.moment_sync_bytes(1000, 2, "none") == (0, 2 * 500 * 4)
    assert traffic.moment_sync_bytes(1000, 2, "int4") == (0, 2 * 500 * 2)
    # padded 1000 fp32 + sent / received / gathered in bf16, and the fp32 mean written back
    assert traffic.moment_peak_bytes(1000, 2, "int4") == 4 * 1000 + 3 * 2 * 1000 + 4 * 1000
    frags, h = [100, 100], 4
    plain = traffic.per_step(frags, 2, "bf16", sync_every=h)
    t = traffic.per_step(frags, 2, "bf16", sync_every=h, moment_every=(3, 6))  # DES-LOC's periods
    moment = traffic.moment_sync_bytes(100, 2, "bf16")[1]
    assert t.mean_inter == pytest.approx(plain.mean_inter + 2 * moment * (1 / 3 + 1 / 6) / h)
    assert t.peak_inter == plain.peak_inter + 2 * moment  # a sync where both moments fall (the 6th)
    assert t.calls_per_interval == pytest.approx(4 * (1 + 1 / 3 + 1 / 6))


def test_stats_and_refusals():
    assert traffic.stats_bytes(GroupShape(4, 1, 2)) == (2 * 8 * 1 // 4, 2 * 8 * 2 // 4)
    with pytest.raises(ValueError, match="quantize 'int8'"):
        traffic.sync_bytes(10, 2, "int8")


def test_int4_wire_carries_the_error_only_with_feedback():
    """With feedback the second encoding of the same values differs (what the first dropped is
    added back) and the two decodings average closer to the values than one does; without it the
    buffer is cleared, so both encodings are the plain rounding of the values."""
    values = torch.linspace(-1, 1, 512) ** 3
    for feedback in (True, False):
        wire = Int4Wire(256, feedback=feedback)
        err = torch.zeros(512)
        first = wire.decode(wire.encode(values, err, 2)).reshape(-1)
        second = wire.decode(wire.encode(values, err, 2)).reshape(-1)
        one = (first - values).abs().mean()
        two = ((first + second) / 2 - values).abs().mean()
        if feedback:
            assert not torch.equal(first, second) and two < 0.75 * one  # measured 0.53
        else:
            assert torch.equal(first, second) and torch.equal(err, values - first)
