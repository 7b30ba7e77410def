"""TensorBoard-style debiased EMA, checked against values worked out by hand."""

import math

import numpy as np
import pytest

from megazpp.analysis.smoothing import ema_debiased
from megazpp.errors import ConfigError


def test_debiased_ema_by_hand():
    # w = 0.5: m1 = 1, 1 / (1 - 0.5) = 2; m2 = 0.5 + 2 = 2.5, 2.5 / 0.75; m3 = 1.25 + 0 = 1.25, / 0.875
    assert ema_debiased(np.array([2.0, 4.0, 0.0]), 0.5) == pytest.approx([2.0, 2.5 / 0.75, 1.25 / 0.875])


def test_first_point_is_the_first_value_and_weight_zero_is_identity():
    values = np.array([5.0, 1.0, 3.0, 2.0])
    assert ema_debiased(values, 0.99)[0] == 5.0
    assert ema_debiased(values, 0.0).tolist() == values.tolist()


def test_nan_passes_through_without_poisoning():
    out = ema_debiased(np.array([2.0, math.nan, 4.0]), 0.5)
    assert out[0] == 2.0 and math.isnan(out[1]) and out[2] == pytest.approx(2.5 / 0.75)


def test_constant_series_stays_constant():
    assert ema_debiased(np.full(5, 0.1), 0.9).tolist() == [0.1] * 5


@pytest.mark.parametrize("weight", [1.0, -0.1, 1.5])
def test_weight_outside_unit_interval_is_refused(weight):
    with pytest.raises(ConfigError, match=f"smoothing weight {weight} is outside"):
        ema_debiased(np.ones(3), weight)
