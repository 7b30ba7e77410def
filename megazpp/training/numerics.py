"""Watching the loss and gradient norm for numerical faults: bad steps and loss spikes.

Why here and not in the engine: the engine already refuses to apply a step whose gradient
norm is not finite (every rank sees the same, globally reduced norm, so all skip together).
What it cannot decide is when skipping has gone on long enough to stop: a run that diverged
under bf16 or fp32 would otherwise skip forever while looking alive. Under fp16 an
overflowing gradient is routine (the loss scaler backs off), so only a non-finite loss
counts as bad there.

A spike is a finite loss above `factor` x the mean of the last `window` good losses; spikes
are reported (and kept out of that mean) but never stop the run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from megazpp.optim.engine_protocol import StepResult


@dataclass(frozen=True)
class StepHealth:
    """The verdict on one step: `bad` (non-finite), how many bad steps in a row, and the
    loss / running-mean ratio when the step was a spike (None otherwise)."""

    bad: bool
    consecutive_bad: int
    spike_ratio: float | None


class NumericsMonitor:
    def __init__(self, *, fp16: bool, spike_factor: float, spike_window: int) -> None:
        self.fp16 = fp16
        self.spike_factor = spike_factor
        self._recent: deque[float] = deque(maxlen=spike_window)
        self.consecutive_bad = 0

    def observe(self, loss: float | None, result: StepResult) -> StepHealth:
        """`loss` is None on ranks that compute none (pipeline stages before the last)."""
        loss_bad = loss is not None and not math.isfinite(loss)
        norm_bad = not self.fp16 and not math.isfinite(result.grad_norm)
        bad = loss_bad or norm_bad
        self.consecutive_bad = self.consecutive_bad + 1 if bad else 0
        ratio = None
        if not bad and loss is not None:
            full = len(self._recent) == self._recent.maxlen
            mean = sum(self._recent) / len(self._recent) if self._recent else 0.0
            if self.spike_factor and full and mean > 0 and loss > self.spike_factor * mean:
                ratio = loss / mean
            else:
                self._recent.append(loss)
        return StepHealth(bad, self.consecutive_bad, ratio)
