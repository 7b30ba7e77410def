"""The outer warmup's ramp (`outer.warmup_syncs`): from plain averaging to the set lr and momentum."""

from __future__ import annotations

import pytest

from megazpp.errors import ConfigError
from megazpp.outer.settings import OuterOptions
from megazpp.outer.update import warmed_up


def test_ramp_starts_at_plain_averaging_and_reaches_the_set_values():
    assert warmed_up(0.7, 0.9, 0, 4) == (1.0, 0.0)
    assert warmed_up(0.7, 0.9, 2, 4) == pytest.approx((0.85, 0.45))
    assert warmed_up(0.7, 0.9, 4, 4) == (0.7, 0.9)
    assert warmed_up(0.7, 0.9, 9, 4) == (0.7, 0.9)
    assert warmed_up(0.7, 0.9, 0, 0) == (0.7, 0.9)  # no warmup: the set values from the first sync


def test_negative_warmup_is_refused_by_name():
    with pytest.raises(ConfigError, match="outer.warmup_syncs = -1"):
        OuterOptions(algorithm="diloco", warmup_syncs=-1)
    with pytest.raises(ConfigError, match="outer.warmup_syncs = 3 is set but outer.algorithm is none"):
        OuterOptions(warmup_syncs=3)
