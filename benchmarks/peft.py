"""The network benchmark's LoRA mode: which configurations run with frozen weights, and the
verdict the PaRO paper's PEFT claim is checked by.

Why a mode: with LoRA most weights are frozen, and the paper's claim is that a strategy that
shards parameters inside the node, keeps gradients whole and shards optimizer state globally
(ING) then beats ZeRO-3. Configurations that cannot run with frozen weights are left out:
the DeepSpeed peer (it trains every weight) and qwZ / hpZ (refused by the engine with frozen
parameters); qgZ acts on the trainable gradients only and stays.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.results import Row
from benchmarks.suite import MEGAZPP, BenchConfig

FROZEN_REFUSED_FLAGS = ("--zero-quantized-weights", "--zero-hpz-partition-size")
TARGET_SPEEDUP, MEMORY_SLACK = 1.5, 1.25


def peft_configs(configs: Sequence[BenchConfig]) -> list[BenchConfig]:
    return [c for c in configs if c.runner == MEGAZPP and not any(f in c.flags for f in FROZEN_REFUSED_FLAGS)]


def verdict(rows: Sequence[Row], pick: str, base: str = "zero3") -> str:
    """One line: `pick`'s tokens/s and peak RSS against `base`'s, and whether the target holds
    (at least 1.5x the tokens/s at no more than 1.25x the peak memory)."""
    by_name = {r.config: r for r in rows}
    mine, theirs = by_name.get(pick), by_name.get(base)
    if (
        mine is None
        or theirs is None
        or mine.tokens_per_s is None
        or theirs.tokens_per_s is None
        or mine.peak_rss_bytes is None
        or theirs.peak_rss_bytes is None
    ):
        return f"verdict: {pick} against {base}: not measured (both must have run)"
    speed = mine.tokens_per_s / theirs.tokens_per_s
    memory = mine.peak_rss_bytes / theirs.peak_rss_bytes
    met = speed >= TARGET_SPEEDUP and memory <= MEMORY_SLACK
    return (
        f"verdict: {pick} {speed:.2f}x {base}'s tokens/s at {memory:.2f}x its peak RSS: target "
        f"(>= {TARGET_SPEEDUP}x at <= {MEMORY_SLACK}x) {'met' if met else 'NOT met'}"
    )
