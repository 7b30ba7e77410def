"""Learning rate as a function of the number of optimizer updates applied so far.

Why counted in updates, not iterations: an fp16 step skipped for overflow changed nothing, so
it must not consume warmup or decay (as in Megatron and DeepSpeed). The schedule is a pure
function of that count, so its whole checkpoint state is one integer.

    warmup (u < W):          lr(u) = lr_max * (u + 1) / W
    decay  (W <= u < D):     p = (u - W) / (D - W)
        cosine:              lr = lr_min + (lr_max - lr_min) * (1 + cos(pi * p)) / 2
        linear:              lr = lr_max - (lr_max - lr_min) * p
        constant:            lr = lr_max
    after decay (u >= D):    lr = lr_min   (lr_max for "constant")
"""

from __future__ import annotations

import math

from megazpp.errors import ConfigError


class LRSchedule:
    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str) -> None:
        if style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"lr decay style {style!r}: expected cosine, linear or constant")
        self.max_lr, self.min_lr, self.style = max_lr, min_lr, style
        self.warmup_iters, self.decay_iters = warmup_iters, decay_iters
        self.num_updates = 0

    def lr_at(self, updates: int) -> float:
        if updates < self.warmup_iters:
            return self.max_lr * (updates + 1) / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if updates >= self.decay_iters:
            return self.min_lr
        progress = (updates - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.style == "cosine":
            return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.max_lr - (self.max_lr - self.min_lr) * progress

    @property
    def lr(self) -> float:
        """The rate for the next update."""
        return self.lr_at(self.num_updates)

    def step(self) -> None:
        """Record one applied update."""
        self.num_updates += 1

    def state_dict(self) -> dict[str, int]:
        return {"num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_updates = int(state["num_updates"])
