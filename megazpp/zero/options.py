"""ZeroOptions: the settings a ZeroEngine is built with, typed and checked when built.

Why a module of its own, and why the checks live in the constructor: zero owns its settings,
so whoever holds a ZeroOptions holds settings that passed every rule concerning only zero
(sizes, modes, persistence and ZeRO++ against the strategy, ZeRO++'s own values in `ZeroPP`),
each refusal naming the config key. The config layer above maps the `zero` section onto this
type by field name (`megazpp.config.options.options_of`) in `config.checks.check_config`, which
runs in run.sh's check before any rank starts and again in each rank's start (the same pure
function of the same inputs). The engine does not parse them again; it repeats two of the
config's cross-section rules for callers that build it without the config (frozen parameters
against the strategy, `zero.frozen.check_frozen_support`; a pipeline-tied embedding against
sharded gradients). This module never imports the config schema: tests and tools build options
directly, with the same checks.

`paro_strategy: auto` is the `PlannerChoice` state. Every rule that does not need the chosen
strategy is checked as for a named one, and the strategy-dependent rules (persistence and each
ZeRO++ switch against p and g) narrow `PlannerChoice.allowed` to the strategies they accept (a
setting no strategy accepts is refused at once). The config's cross-section rules narrow it
further (`narrowed`: frozen parameters, a pipeline-tied embedding), and the planner only picks
among `allowed` (`chosen` refuses anything else as a bug), so none of these rules can refuse the
strategy the ranks run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from megazpp.errors import ConfigError
from megazpp.zero.sequences import Hierarchy
from megazpp.zero.strategy import Level, PlannerChoice, Strategy
from megazpp.zero.traffic import HIERARCHY_MODES
from megazpp.zero.units import FETCH_GROUP_MODES
from megazpp.zero.zeropp import ZeroPP, zeropp_refusal

HierarchyMode = Literal["auto", "always", "never"]

_POSITIVE = ("reduce_bucket_size", "allgather_bucket_size", "paro_group_size")
_NON_NEGATIVE = (
    "module_granularity_threshold",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_param_persistence_threshold",
)


@dataclass(frozen=True)
class ZeroOptions:
    """How the engine partitions and moves state, under the `zero` section's own names and
    defaults (DeepSpeed's keys; `megazpp.config.schema.ZeroConfig` takes its defaults from here).
    `strategy` is a parsed Strategy, or PlannerChoice until the planner chose (`chosen`)."""

    strategy: Strategy | PlannerChoice = Strategy(Level.N, Level.N, Level.N)  # the section's: stage 0, DDP
    paro_group_size: int | None = None  # None: the DP ranks on one node
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    module_granularity_threshold: int = 0
    fetch_groups: str = "layer"  # units.FETCH_GROUP_MODES
    stage3_prefetch_bucket_size: int = 50_000_000  # elements of groups gathered ahead of use
    stage3_max_live_parameters: int = 1_000_000_000  # elements kept gathered forward -> backward
    stage3_max_reuse_distance: int = 1_000_000_000  # kept only if reused within this many elements
    # parameters of fewer elements stay whole on every rank (p sharded); 0: none (DeepSpeed: 1e5)
    stage3_param_persistence_threshold: int = 0
    # a mode of traffic.HIERARCHY_MODES, or the per-kind choice made above zero (the planner)
    hierarchical: HierarchyMode | Hierarchy = "auto"
    overlap_comm: bool = True  # False: no prefetch, each reduction waited at once
    micro_batches_per_step: int | None = None  # known: start the boundary reduction in backward
    zeropp: ZeroPP = field(default_factory=ZeroPP)  # qwZ, hpZ, qgZ, LoCo (checked when built)

    def __post_init__(self) -> None:
        """ConfigError naming the `zero` key for the first setting the engine cannot run; under
        PlannerChoice, `allowed` narrowed to the strategies these settings accept."""
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"zero.{name} = {value!r}: expected a value > 0")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ConfigError(f"zero.{name} = {getattr(self, name)}: expected a value >= 0")
        if self.fetch_groups not in FETCH_GROUP_MODES:
            raise ConfigError(
                f"zero.fetch_groups = {self.fetch_groups!r}: expected one of {', '.join(FETCH_GROUP_MODES)}"
            )
        if not isinstance(self.hierarchical, Hierarchy) and self.hierarchical not in HIERARCHY_MODES:
            raise ConfigError(
                f"zero.hierarchical = {self.hierarchical!r}: expected one of {', '.join(HIERARCHY_MODES)}"
            )
        if isinstance(self.strategy, Strategy):
            reason = self.refusal(self.strategy)
            if reason is not None:
                raise ConfigError(reason)
            return
        allowed = tuple(s for s in self.strategy.allowed if self.refusal(s) is None)
        if not allowed:
            first = self.refusal(self.strategy.allowed[0]) if self.strategy.allowed else None
            raise ConfigError(f"zero.paro_strategy = auto: no strategy accepts these settings ({first})")
        object.__setattr__(self, "strategy", PlannerChoice(allowed))  # normalised once, at construction

    def refusal(self, strategy: Strategy) -> str | None:
        """Why these settings cannot run under `strategy` (naming the key), or None."""
        threshold = self.stage3_param_persistence_threshold
        if threshold > 0 and strategy.params == Level.N:
            return (
                f"zero.stage3_param_persistence_threshold = {threshold}: strategy {strategy} keeps "
                f"every parameter whole already (p = N); set it to 0 or shard parameters (p = I or G)"
            )
        reason = zeropp_refusal(self.zeropp, strategy)
        return None if reason is None else f"zero strategy {strategy}: {reason}"

    @property
    def resolved(self) -> Strategy:
        """The strategy to run; ValueError while the planner has not chosen (a caller's bug:
        `paro_strategy: auto` is resolved by `chosen` before an engine is built)."""
        if not isinstance(self.strategy, Strategy):
            raise ValueError("ZeroOptions: paro_strategy auto has not been chosen yet (ZeroOptions.chosen)")
        return self.strategy

    def narrowed(self, refusal: Callable[[Strategy], str | None]) -> ZeroOptions:
        """A rule from outside the `zero` section (the config's cross-section checks) applied
        to the strategy: `refusal(s)` says why `s` cannot run, or None. A named strategy it
        refuses is refused; under PlannerChoice `allowed` keeps the strategies it accepts
        (none left: refused with the first reason)."""
        if isinstance(self.strategy, Strategy):
            reason = refusal(self.strategy)
            if reason is not None:
                raise ConfigError(reason)
            return self
        allowed = tuple(s for s in self.strategy.allowed if refusal(s) is None)
        if not allowed:
            raise ConfigError(
                f"zero.paro_strategy = auto: no strategy fits the settings ({refusal(self.strategy.allowed[0])})"
            )
        return dataclasses.replace(self, strategy=PlannerChoice(allowed))

    def chosen(self, strategy: Strategy) -> ZeroOptions:
        """These options with the planner's pick; ValueError (a planner bug, not user input)
        for a strategy outside `allowed`."""
        if not isinstance(self.strategy, PlannerChoice) or strategy not in self.strategy.allowed:
            raise ValueError(f"ZeroOptions.chosen({strategy}): not among the strategies the settings allow")
        return dataclasses.replace(self, strategy=strategy)
