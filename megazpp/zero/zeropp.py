"""The ZeRO++ settings (`ZeroPP`, its wire formats), checked when built, the rule that ties
them to the strategy (`zeropp_refusal`, applied by `ZeroOptions`), and hpZ's group size
settled on the topology.

Why refusals here: each ZeRO++ path replaces one collective of the strategy, so it only means
something where that collective exists. qwZ and hpZ act on parameter gathers (p in {I, G});
qgZ on the per-micro-batch gradient reduction (g in {I, G}); LoCo corrects qgZ's 4-bit
gradients. Anything else would be a switch that silently does nothing, so it is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from kernels.api import CPU_KERNELS
from kernels.format import check_block_size, check_err_beta
from megazpp.errors import ConfigError
from megazpp.parallel.topology import Topology
from megazpp.zero.strategy import Level, Strategy


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A block-quantized wire format (ZeRO++): `bits`-bit codes plus one fp32 scale per `block`."""

    bits: int
    block: int

    def nbytes(self, numel: int) -> int:
        """Wire bytes of `numel` elements; exact because every chunk is block-aligned."""
        return numel * self.bits // 8 + numel // self.block * 4


def _key(name: str) -> dict[str, str]:
    """Field metadata: the `zero` config key (DeepSpeed's name) a ZeroPP field is read from."""
    return {"key": name}


@dataclasses.dataclass(frozen=True)
class ZeroPP:
    """Which ZeRO++ paths are on, their quantization blocks, and which CPU kernels run them;
    checked when built (`__post_init__`), so whoever holds one holds valid settings.

    qwZ: parameter gathers from the primary shard move int8 codes + scales (`weights`).
    hpZ: `hpz` > 1 keeps a secondary copy of the parameters split over `hpz` DP ranks of one
    node, filled from the forward gather; backward gathers only from it (`hpz_fetch_sequence`).
    qgZ: the per-micro-batch gradient reduction is one int4 all-to-all per stage
    (`qgz_sequence`, `grads`); `loco` adds LoCo error feedback to both stages.
    Each field's metadata names the `zero` config key it is read from (the config maps the
    section onto this type by those names), and its refusals name that key.
    """

    qwz: bool = dataclasses.field(default=False, metadata=_key("zero_quantized_weights"))
    hpz: int = dataclasses.field(default=1, metadata=_key("zero_hpz_partition_size"))
    qgz: bool = dataclasses.field(default=False, metadata=_key("zero_quantized_gradients"))
    loco: bool = dataclasses.field(default=False, metadata=_key("loco"))
    qwz_block: int = dataclasses.field(default=2048, metadata=_key("qwz_block_size"))
    qgz_block: int = dataclasses.field(default=256, metadata=_key("qgz_block_size"))
    # LoCo: weight of the old error in the blended buffer
    err_beta: float = dataclasses.field(default=0.8, metadata=_key("loco_err_beta"))
    # LoCo: buffers are zeroed after every reset_t optimizer steps
    reset_t: int = dataclasses.field(default=1024, metadata=_key("loco_reset_t"))
    # kernels.CPU_KERNELS: eager torch, or compiled
    cpu_kernels: str = dataclasses.field(default="reference", metadata=_key("cpu_quant_kernels"))

    def __post_init__(self) -> None:
        """ConfigError naming the `zero` key for a value the ZeRO++ paths cannot run with; the
        only place these keys are checked (the kernels check their arguments, as arguments)."""
        if self.loco and not self.qgz:
            raise ConfigError(
                "zero.loco (zeropp_loco_param): LoCo corrects qgZ's 4-bit gradients; "
                "it needs zero.zero_quantized_gradients = true"
            )
        if self.hpz < 1:
            raise ConfigError(f"zero.zero_hpz_partition_size = {self.hpz!r}: expected a value > 0")
        for name in ("qwz_block", "qgz_block"):
            try:
                check_block_size(getattr(self, name))
            except ValueError as err:
                raise ConfigError(f"zero.{zeropp_key(name)}: {err}") from None
        try:
            check_err_beta(self.err_beta)
        except ValueError as err:
            raise ConfigError(f"zero.loco_err_beta (zeropp_loco_param.err_beta): {err}") from None
        if self.cpu_kernels not in CPU_KERNELS:
            raise ConfigError(
                f"zero.cpu_quant_kernels = {self.cpu_kernels!r}: expected one of {', '.join(map(repr, CPU_KERNELS))}"
            )
        if self.cpu_kernels == "compiled" and self.enabled:
            from kernels import cpu_compiled  # imported lazily: torch.compile is slow to import

            try:
                cpu_compiled.require_compiler()
            except RuntimeError as err:
                raise ConfigError(f"zero.cpu_quant_kernels = 'compiled': {err}") from None
        if self.reset_t < 1:
            raise ConfigError(f"zero.loco_reset_t = {self.reset_t}: expected a positive step count")

    @property
    def enabled(self) -> bool:
        return self.qwz or self.hpz > 1 or self.qgz

    @property
    def weights(self) -> QuantFormat:
        return QuantFormat(8, self.qwz_block)

    @property
    def grads(self) -> QuantFormat:
        return QuantFormat(4, self.qgz_block)

    def alignment(self) -> int:
        """Elements every DP shard of a bucket must be a multiple of, so that each chunk of
        every quantized all-gather / all-to-all is whole blocks (no unquantized fallback)."""
        blocks = [b for on, b in ((self.qwz, self.qwz_block), (self.qgz, self.qgz_block)) if on]
        return math.lcm(*blocks) if blocks else 1


def zeropp_key(name: str) -> str:
    """The `zero` config key a ZeroPP field is read from."""
    return str(next(f for f in dataclasses.fields(ZeroPP) if f.name == name).metadata["key"])


def zeropp_refusal(zeropp: ZeroPP, strategy: Strategy) -> str | None:
    """Why `strategy` gives a ZeRO++ switch that is on nothing to act on, or None: the one rule
    behind `ZeroOptions`' refusal and the planner's options (`planner.plan.applies`)."""
    if (zeropp.qwz or zeropp.hpz > 1) and strategy.params == Level.N:
        return (
            "zero_quantized_weights / zero_hpz_partition_size act on parameter all-gathers, and "
            "p = N keeps parameters whole on every rank (nothing is gathered); use a strategy "
            "with p in {I, G}, e.g. stage 3"
        )
    if zeropp.qgz and strategy.grads == Level.N:
        return (
            "zero_quantized_gradients quantizes the per-micro-batch gradient reduction, and "
            "g = N has none (gradients are reduced once per step in the accumulation dtype); "
            "use a strategy with g in {I, G}, e.g. stage 2 or 3"
        )
    return None


def resolve_zeropp(zeropp: ZeroPP, topology: Topology) -> ZeroPP:
    """The ZeRO++ settings this engine runs with on `topology`.

    hpZ's group is `zeropp.hpz` consecutive DP ranks that must share a node (its point is an
    intra-node backward gather). A size above the DP ranks of one node (the ZeRO++ tutorial
    asks for 16, the GPUs of its nodes) is lowered to that count, so a config written for
    larger nodes runs unchanged; on one DP rank ZeRO++ is off (nothing crosses a link). The
    start-up banner says both, once (`megazpp.training.banner`), from the requested and the
    returned settings. `zeropp` was checked (its own rules, and against the strategy) when it
    and its `ZeroOptions` were built.
    """
    if not zeropp.enabled:
        return zeropp
    d = topology.dp
    if d == 1:
        return ZeroPP()
    hpz = _hpz_size(zeropp.hpz, topology)
    return zeropp if hpz == zeropp.hpz else dataclasses.replace(zeropp, hpz=hpz)


def _hpz_size(requested: int, topology: Topology) -> int:
    """hpZ's group size on `topology`: `hpz_group_size` for this rank's DP group and node."""
    return hpz_group_size(requested, list(topology.dp_ranks), topology.node_of, topology.node)


def hpz_group_size(requested: int, dp_ranks: list[int], node_of: Callable[[int], int], node: int) -> int:
    """hpZ's group size for the DP group `dp_ranks` seen from `node`: `requested` lowered to
    the group's ranks on that node; 1 (hpZ off: there is nothing inside a node to split) when
    a node holds one DP rank, as the tutorial's 16 on nodes of one rank each
    (`--ranks-per-node 1`). A pure function of the layout, so the config checks it for every
    group and node before any rank starts (`config.checks`), and the engine only resolves."""
    if requested <= 1:
        return 1
    on_node = sum(1 for r in dp_ranks if node_of(r) == node)
    size = min(requested, on_node)
    if size == 1:
        return 1
    if len(dp_ranks) % size:
        raise ConfigError(
            f"zero.zero_hpz_partition_size = {size}: expected a divisor of the data-parallel size {len(dp_ranks)}"
        )
    for start in range(0, len(dp_ranks), size):
        nodes = {node_of(r) for r in dp_ranks[start : start + size]}
        if len(nodes) > 1:
            raise ConfigError(
                f"zero.zero_hpz_partition_size = {size}: the group of DP ranks "
                f"{dp_ranks[start : start + size]} spans nodes {sorted(nodes)}; hpZ's "
                f"group must lie inside one node (use a divisor of the DP ranks per node)"
            )
    return size
