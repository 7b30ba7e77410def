"""ZeroOptions: the `zero` config section, the settings a ZeroEngine is built with, checked when built.

Why a module of its own, and why the checks live in the constructor: zero owns its settings.
The config layer above reads YAML keys, DeepSpeed's `zero_optimization` and flags onto these
fields by name, and its check adds what other sections decide (`micro_batches_per_step`,
`narrowed`) once, before any rank starts; every rule that concerns only zero (sizes, modes,
keys not implemented, persistence and ZeRO++ against the strategy, ZeRO++'s own values in
`ZeroPP`) is checked here, naming the config key, so whoever holds a ZeroOptions holds valid
settings and the engine does not parse them again; it repeats two of the config's cross-section
rules for callers that build it without the config (frozen parameters against the strategy,
`zero.frozen.frozen_refusal`; a pipeline-tied embedding against sharded gradients). This
module never imports the config: tests and tools build options directly, with the same checks.

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
from dataclasses import dataclass, field, fields

from megazpp.errors import ConfigError
from megazpp.setting import resolved, setting
from megazpp.zero.sequences import Hierarchy
from megazpp.zero.strategy import Level, PlannerChoice, Strategy, strategy_setting
from megazpp.zero.traffic import HIERARCHY_MODES
from megazpp.zero.units import FETCH_GROUP_MODES
from megazpp.zero.zeropp import ZeroPP, zeropp_refusal

_POSITIVE = ("reduce_bucket_size", "allgather_bucket_size", "paro_group_size")
_NON_NEGATIVE = (
    "module_granularity_threshold",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_param_persistence_threshold",
)


# keys accepted only at their default: the feature they would switch is not built (refused,
# naming the key); remove an entry in the same commit that makes the feature work
NOT_IMPLEMENTED_YET: dict[str, str] = {
    "contiguous_gradients": "ZeRO without contiguous gradient buffers (buckets are flat)",
    "reduce_scatter": "ZeRO reducing gradients by all-reduce instead of reduce-scatter to their shard level",
}


@dataclass(frozen=True)
class ZeroOptions:
    """The `zero` section: a PaRO strategy or a ZeRO stage, bucket and fetch sizes, ZeRO++.

    Field names follow DeepSpeed's `zero_optimization` keys so its JSON maps one to one, and
    mean what they mean there. The defaults of DeepSpeed's keys are DeepSpeed 0.19.8's except
    two: `overlap_comm` is on at every stage (DeepSpeed, when the key is absent: on for stage 3
    only), because this engine overlaps alike under every strategy and false only serializes
    it; `stage3_param_persistence_threshold` is 0 (DeepSpeed: 1e5), because with layer fetch
    groups small tensors already travel in their layer's one collective, and a threshold is
    refused with p = N strategies (stages 0-2) and with frozen parameters. `fetch_groups`,
    `hierarchical`, `cpu_quant_kernels`, the block sizes, `paro_strategy` and `paro_group_size`
    are megazpp's own. With stage 0 and no `paro_strategy`, a data-parallel run uses strategy
    NNN (plain DDP); `paro_strategy: auto` lets the planner choose at start-up from the
    `planner` section (docs/planning.md).

    Derived when built: `strategy` (a Strategy, or PlannerChoice until the planner chose:
    `chosen`) and `zeropp` (the ZeRO++ keys as `ZeroPP`). The config's check fills the
    `resolved` fields from other sections (`micro_batches_per_step`, and `narrowed` strategies).
    """

    stage: int = setting(0, "ZeRO stage 0-3 (aliases of PaRO NNN, NNG, NGG, GGG)")
    paro_strategy: str | None = setting(None, "PaRO triple (e.g. NIG, III) or auto (the planner picks)")
    paro_group_size: int | None = setting(None, "ranks of a PaRO I group; none: the node")
    reduce_bucket_size: int = setting(500_000_000, "elements per gradient bucket (also bounds a fetch group)")
    allgather_bucket_size: int = setting(500_000_000, "elements per parameter fetch group at most")
    contiguous_gradients: bool = setting(True, "always on (flat buckets)")
    # DeepSpeed's: on for stage 3 only; false: no prefetch, each reduction waited at once
    overlap_comm: bool = setting(True, "prefetch groups and overlap reductions with backward; false: wait each at once")
    reduce_scatter: bool = setting(True, "always on (gradients reduced to their shard level)")
    zero_quantized_weights: bool = setting(False, "qwZ: int8 parameter all-gather")
    zero_hpz_partition_size: int = setting(1, "hpZ: ranks of the node-local secondary parameter copy")
    zero_quantized_gradients: bool = setting(False, "qgZ: int4 gradient all-to-all")
    loco: bool = setting(False, "LoCo error feedback for qgZ")
    loco_err_beta: float = setting(0.8, "LoCo error decay")
    loco_reset_t: int = setting(1024, "LoCo buffer reset period (steps)")
    module_granularity_threshold: int = setting(0, "fetch modules finer than this whole (coalesced)")
    # parameter fetch (p sharded): groups, prefetch depth and reuse, DeepSpeed's meanings
    fetch_groups: str = setting(
        "layer",
        "layer (one fetch group per transformer layer) or size (execution-order, bounded in elements)",
    )
    stage3_prefetch_bucket_size: int = setting(50_000_000, "elements of fetch groups gathered ahead of use")
    stage3_max_live_parameters: int = setting(
        1_000_000_000, "elements kept gathered from forward to backward (0: re-gather in backward)"
    )
    stage3_max_reuse_distance: int = setting(
        1_000_000_000, "keep a group for backward only if reused within this many elements"
    )
    stage3_param_persistence_threshold: int = setting(
        0,
        "parameters of fewer elements stay whole on every rank, refreshed after each step in one collective (0: none)",
    )
    hierarchical: str = setting(
        "auto", "two-stage (node, then across nodes) collectives: auto (the planner prices them), always or never"
    )
    cpu_quant_kernels: str = setting("reference", "reference or compiled (TorchInductor) quantizers on CPU")
    qwz_block_size: int = setting(2048, "values per int8 scale in qwZ")
    qgz_block_size: int = setting(256, "values per int4 scale in qgZ")
    micro_batches_per_step: int | None = resolved(
        None, "the training batch over the DP ranks: known, the engine starts the boundary reduction in backward"
    )
    hierarchy: Hierarchy | None = resolved(
        None, "under hierarchical auto, the planner's per-kind choice of two-stage collectives, taken as given"
    )
    choice: Strategy | PlannerChoice | None = resolved(
        None, "the strategy as narrowed by other sections' rules or chosen by the planner (None: from the keys)"
    )
    strategy: Strategy | PlannerChoice = field(init=False)  # `choice`, else the keys' (rebuilt by replace)
    zeropp: ZeroPP = field(init=False)  # the ZeRO++ keys, as the engine's paths take them

    def __post_init__(self) -> None:
        """ConfigError naming the `zero` key for the first setting the engine cannot run; under
        PlannerChoice, the allowed strategies narrowed to those these settings accept."""
        for name, feature in NOT_IMPLEMENTED_YET.items():
            value, default = getattr(self, name), next(f.default for f in fields(self) if f.name == name)
            if value != default:
                raise ConfigError(f"zero.{name} = {value!r}: {feature} is not implemented yet")
        strategy = self.choice if self.choice is not None else strategy_setting(self.paro_strategy, self.stage)
        object.__setattr__(self, "zeropp", ZeroPP(**{f.name: getattr(self, f.metadata["key"]) for f in fields(ZeroPP)}))
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
        if self.hierarchical not in HIERARCHY_MODES:
            raise ConfigError(
                f"zero.hierarchical = {self.hierarchical!r}: expected one of {', '.join(HIERARCHY_MODES)}"
            )
        if isinstance(strategy, Strategy):
            reason = self.refusal(strategy)
            if reason is not None:
                raise ConfigError(reason)
        else:
            allowed = tuple(s for s in strategy.allowed if self.refusal(s) is None)
            if not allowed:
                first = self.refusal(strategy.allowed[0]) if strategy.allowed else None
                raise ConfigError(f"zero.paro_strategy = auto: no strategy accepts these settings ({first})")
            strategy = PlannerChoice(allowed)
        object.__setattr__(self, "strategy", strategy)  # normalised once, at construction

    def runs_engine(self, dp: int) -> bool:
        """Whether a run over `dp` data-parallel ranks needs the ZeRO engine: data parallel, or
        a stage / PaRO strategy asked for (stage 0 over dp > 1 is NNN: plain DDP); else the
        single-replica engine (`optim.local_engine.LocalEngine`)."""
        return dp > 1 or self.stage != 0 or self.paro_strategy is not None

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
        return dataclasses.replace(self, choice=PlannerChoice(allowed))

    def chosen(self, strategy: Strategy) -> ZeroOptions:
        """These options with the planner's pick; ValueError (a planner bug, not user input)
        for a strategy outside `allowed`."""
        if not isinstance(self.strategy, PlannerChoice) or strategy not in self.strategy.allowed:
            raise ValueError(f"ZeroOptions.chosen({strategy}): not among the strategies the settings allow")
        return dataclasses.replace(self, choice=strategy)


def tied_split_refusal(strategy: Strategy) -> str | None:
    """Why `strategy` cannot train an embedding tied across pipeline stages, or None: the
    pipeline sums the two copies' gradients through `ZeroEngine.grad_for` before `step()`,
    which needs this rank's whole accumulated gradient, kept only with g = N. The config check
    narrows the strategy by it; the engine refuses it for callers that build it directly."""
    if strategy.grads == Level.N:
        return None
    return (
        f"zero strategy {strategy}: gradients sharded (g = {strategy.grads.name}) cannot be combined with tied "
        f"embeddings split over pipeline stages; use a strategy with g = N (e.g. NNG, INI, GNG) "
        f"or model.tie_embeddings: false"
    )
