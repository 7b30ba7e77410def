"""TensorBoard's scalar smoothing, so a curve in our PNG looks like the one in TensorBoard.

An exponential moving average started from zero is biased towards zero for its first
points; dividing by (1 - w^n) after n points removes that bias, so the smoothed curve starts
at the first value instead of climbing from 0. Non-finite points (a NaN loss) pass through
unsmoothed and do not poison the average, and a constant series stays exactly constant.
"""

from __future__ import annotations

import math

import numpy as np

from megazpp.errors import ConfigError


def ema_debiased(values: np.ndarray, weight: float) -> np.ndarray:
    """smoothed_n = m_n / (1 - w^n) with m_n = w m_{n-1} + (1 - w) y_n, m_0 = 0, where n
    counts the finite points so far; weight 0 returns the values unchanged."""
    check_weight(weight)
    values = np.asarray(values, dtype=np.float64)
    if len(values) and np.all(values == values[0]):
        return np.array(values)
    smoothed = np.empty_like(values)
    mean, count = 0.0, 0
    for i, value in enumerate(values):
        if not math.isfinite(value):
            smoothed[i] = value
            continue
        mean = weight * mean + (1.0 - weight) * value
        count += 1
        smoothed[i] = mean / (1.0 - weight**count)
    return smoothed


def check_weight(weight: float) -> None:
    """Refuse a weight of 1 or more (the average would never move) or below 0."""
    if not 0.0 <= weight < 1.0:
        raise ConfigError(
            f"smoothing weight {weight} is outside [0, 1) (0 = no smoothing, 0.9 = TensorBoard's usual setting)"
        )


def auto_weight(points: int) -> float:
    """A smoothing weight for a curve of `points` points: an averaging window of about a
    tenth of the curve (an EMA of weight w averages ~1/(1-w) points), at most TensorBoard's
    usual 0.9, and none for 10 points or fewer. A fixed 0.9 on an 8-point run ends the
    smoothed curve far above the real final loss."""
    return min(0.9, max(0.0, 1.0 - 10.0 / points)) if points > 0 else 0.0
