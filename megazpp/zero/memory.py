"""Model-state bytes one rank holds between steps, per strategy (and ZeRO++ path state).

Why closed form: the engine's tests check the tensors it allocates against these numbers and
the planner predicts memory with them, so a strategy's memory is stated once. Sizes are the
padded bucket sizes of `layout.padded_numel`; level N holds P elements, I holds P / k, G holds
P / D (`strategy.level_div`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megazpp.optim.options import ADAMW_STATE
from megazpp.zero.sequences import DPShapes, Hierarchy, qgz_sequence
from megazpp.zero.strategy import Level, Strategy, level_div
from megazpp.zero.zeropp import ZeroPP


def optimizer_bytes_per_element(optimizer_states: int) -> int:
    """Bytes per os-shard element: the fp32 master and the optimizer's fp32 state tensors
    (`OptimizerOptions.state_names`: AdamW 2, so 12 bytes; SGD 1 with momentum, 0 without)."""
    return 4 * (1 + optimizer_states)


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds between steps."""

    params: int
    grads: int
    optimizer: int
    path_state: int = 0  # ZeRO++: hpZ secondary shard, LoCo error buffers

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.path_state


def state_bytes(
    s: Strategy,
    padded_numels: Iterable[int],
    d: int,
    k: int,
    param_bytes: int,
    accum_bytes: int,
    persistent: int = 0,
    optimizer_states: int = len(ADAMW_STATE),
) -> StateBytes:
    """Parameters at p (model dtype), gradient accumulators at g, fp32 master + the optimizer's
    `optimizer_states` fp32 state tensors at os; the last `persistent` buckets hold their
    parameters whole (`units.split_persistent`)."""
    params = grads = optim = 0
    numels = list(padded_numels)
    for i, n in enumerate(numels):
        params += n // level_div(Level.N if i >= len(numels) - persistent else s.params, d, k) * param_bytes
        grads += n // level_div(s.grads, d, k) * accum_bytes
        optim += n // level_div(s.optimizer_state, d, k) * optimizer_bytes_per_element(optimizer_states)
    return StateBytes(params, grads, optim)


def zeropp_state_bytes(
    padded_numels: Iterable[int],
    shapes: DPShapes,
    hier: Hierarchy,
    zeropp: ZeroPP,
    param_bytes: int,
    strategy: Strategy,
    persistent: int = 0,
) -> int:
    """Per-rank bytes of ZeRO++ path state: hpZ's secondary shard (model dtype; not for the last
    `persistent` buckets, never fetched) and LoCo's error buffers (fp32, one per qgZ stage), twice:
    the live buffers and the copy a skipped step restores (`loco.LocoState`)."""
    total = 0
    numels = list(padded_numels)
    for i, n in enumerate(numels):
        if zeropp.hpz > 1 and i < len(numels) - persistent:
            total += n // zeropp.hpz * param_bytes
        if zeropp.loco:
            for c in qgz_sequence(strategy, shapes, hier):
                total += 2 * 4 * (n // c.numel_div)
    return total


def outer_state_bytes(s: Strategy, padded_numels: Iterable[int], d: int, k: int, fp32_copies: int) -> int:
    """Per-rank bytes of two-level training's outer state (`megazpp.outer`): `fp32_copies` fp32
    vectors the size of the os shard (the snapshot at the last sync and the outer momentum),
    sharded like the optimizer state. `DiLoCoEngine.expected_bytes` adds int4's error buffers
    (per fragment: the fragment padded, and one chunk of it), and `expected_sync_peak_bytes`
    what a sync holds while it runs (`outer.traffic.exchange_bytes` and the landing's vectors)."""
    return sum(n // level_div(s.optimizer_state, d, k) * 4 * fp32_copies for n in padded_numels)
