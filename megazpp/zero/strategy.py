"""A PaRO partitioning strategy as data: the triple (p, g, os) over the levels N < I < G.

Why data and not code paths: the engine derives every buffer size and every collective from
the three levels, so ZeRO-1/2/3, MiCS, DDP and the other PaRO strategies are one code path
and the stage numbers users know from DeepSpeed are just aliases of triples.

Levels: N = replicated on every data-parallel rank, I = sharded inside a PaRO group
(`paro_group_size` consecutive DP ranks, by default a node), G = sharded over all DP ranks.
The optimizer state must be at least as finely sharded as parameters and gradients (a rank
updates only what it owns, and owns nothing it cannot read), which leaves 14 valid triples.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from megazpp.errors import ConfigError


class Level(enum.IntEnum):
    """How finely one kind of model state is sharded; larger means finer."""

    N = 0
    I = 1  # noqa: E741 - the letter is the paper's name for the level
    G = 2


@dataclass(frozen=True)
class Strategy:
    """Sharding level of parameters (p), gradients (g) and optimizer state (os)."""

    params: Level
    grads: Level
    optimizer_state: Level

    @property
    def name(self) -> str:
        return f"{self.params.name}{self.grads.name}{self.optimizer_state.name}"

    def __str__(self) -> str:
        return self.name


def level_div(level: Level, d: int, k: int) -> int:
    """Into how many shards `level` cuts a buffer over D = `d` DP ranks in PaRO groups of `k`."""
    return {Level.N: 1, Level.I: k, Level.G: d}[level]


def _is_valid(p: Level, g: Level, os_: Level) -> bool:
    return os_ >= p and os_ >= g


VALID_STRATEGIES: tuple[Strategy, ...] = tuple(
    Strategy(p, g, o) for o, p, g in itertools.product(Level, Level, Level) if _is_valid(p, g, o)
)
VALID_NAMES: tuple[str, ...] = tuple(s.name for s in VALID_STRATEGIES)

# DeepSpeed stage numbers and the named systems of the PaRO paper.
ALIASES: dict[str, str] = {
    "0": "NNN",
    "1": "NNG",
    "2": "NGG",
    "3": "GGG",
    "DDP": "NNN",
    "ZERO1": "NNG",
    "ZERO2": "NGG",
    "ZERO3": "GGG",
    "MICS": "III",
}


def parse_strategy(value: str | int | Strategy, *, key: str = "paro_strategy") -> Strategy:
    """Turn a config value ("nig", "NIG", 3, "mics", ...) into a Strategy or raise ConfigError."""
    if isinstance(value, Strategy):
        return value
    text = str(value).strip().upper().replace("-", "").replace("_", "")
    text = ALIASES.get(text, text)
    if len(text) == 3 and all(c in Level.__members__ for c in text):
        p, g, o = (Level[c] for c in text)
        if _is_valid(p, g, o):
            return Strategy(p, g, o)
        raise ConfigError(
            f"{key}={value!r}: optimizer state must be sharded at least as finely as "
            f"parameters and gradients (N < I < G); valid strategies: "
            f"{', '.join(VALID_NAMES)} (or ZeRO stage 0-3, 'mics')"
        )
    raise ConfigError(
        f"{key}={value!r} is not a strategy; expected one of {', '.join(VALID_NAMES)}, a ZeRO stage 0-3, or 'mics'"
    )


def resolve_strategy(paro_strategy: str | None, stage: int) -> Strategy:
    """The strategy of the `zero` keys `paro_strategy` and `stage`: `paro_strategy` wins over
    `stage`, and both given and disagreeing is an error."""
    if paro_strategy is None:
        return parse_strategy(stage, key="zero.stage")
    strategy = parse_strategy(paro_strategy, key="zero.paro_strategy")
    if stage != 0 and parse_strategy(stage) != strategy:
        raise ConfigError(
            f"zero.paro_strategy = {paro_strategy!r} and zero.stage = {stage} disagree "
            f"(stage {stage} is {parse_strategy(stage)}); set one of them"
        )
    return strategy


@dataclass(frozen=True)
class PlannerChoice:
    """`paro_strategy: auto`: the strategy is chosen by the planner once the ranks can measure
    their links, among `allowed`. `ZeroOptions` narrows `allowed` to the strategies its other
    settings accept (and the config's cross-section rules narrow it further), so the planner's
    pick cannot be refused after the ranks started."""

    allowed: tuple[Strategy, ...] = VALID_STRATEGIES


def strategy_setting(paro_strategy: str | None, stage: int) -> Strategy | PlannerChoice:
    """The `zero` keys `paro_strategy` / `stage` as data: a Strategy, or PlannerChoice for
    `auto` (which `stage` does not override: the planner decides)."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero.stage = {stage}: expected 0, 1, 2 or 3")
    if paro_strategy is not None and str(paro_strategy).strip().lower() == "auto":
        return PlannerChoice()
    return resolve_strategy(paro_strategy, stage)
