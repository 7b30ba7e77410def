"""fp16 loss scaling: keep small gradients representable in half precision.

The loss is multiplied by `scale` before backward and gradients are divided by it before the
update. A step whose gradients overflowed (any inf/NaN) is skipped. Dynamic scaling halves
the scale after `hysteresis` consecutive overflowing steps (never below `min_scale`) and
doubles it after `growth_interval` consecutive good steps, so it tracks the largest scale
that does not overflow. A static scaler (`dynamic=False`) only skips.
"""

from __future__ import annotations

from megazpp.optim.options import PrecisionOptions


class LossScaler:
    def __init__(
        self,
        initial_scale: float,
        *,
        dynamic: bool = True,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 1,
    ) -> None:
        self.scale = float(initial_scale)
        self.dynamic, self.min_scale = dynamic, float(min_scale)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def scaler_for(precision: PrecisionOptions) -> LossScaler | None:
    """The scaler the precision options ask for: None outside fp16; in fp16 dynamic when
    `loss_scale` is 0 (DeepSpeed's convention), else static at `loss_scale`."""
    if not precision.fp16:
        return None
    dynamic = precision.loss_scale == 0
    return LossScaler(
        precision.initial_loss_scale if dynamic else precision.loss_scale,
        dynamic=dynamic,
        min_scale=precision.min_loss_scale,
        growth_interval=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )
