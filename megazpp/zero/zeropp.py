"""The ZeRO++ settings (`ZeroPP`, its wire formats), checked against the strategy and the
topology, with hpZ's group size settled.

Why refusals here: each ZeRO++ path replaces one collective of the strategy, so it only means
something where that collective exists. qwZ and hpZ act on parameter gathers (p in {I, G});
qgZ on the per-micro-batch gradient reduction (g in {I, G}); LoCo corrects qgZ's 4-bit
gradients. Anything else would be a switch that silently does nothing, so it is refused.
"""

from __future__ import annotations

import dataclasses
import math

from kernels.api import check_cpu_kernels
from kernels.format import check_block_size, check_err_beta
from megazpp.config.schema import ZeroConfig
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


@dataclasses.dataclass(frozen=True)
class ZeroPP:
    """Which ZeRO++ paths are on, their quantization blocks, and which CPU kernels run them.

    qwZ: parameter gathers from the primary shard move int8 codes + scales (`weights`).
    hpZ: `hpz` > 1 keeps a secondary copy of the parameters split over `hpz` DP ranks of one
    node, filled from the forward gather; backward gathers only from it (`hpz_fetch_sequence`).
    qgZ: the per-micro-batch gradient reduction is one int4 all-to-all per stage
    (`qgz_sequence`, `grads`); `loco` adds LoCo error feedback to both stages.
    Defaults are the `zero` section's (`zeropp_of` maps the keys), so the two never disagree.
    """

    qwz: bool = ZeroConfig.zero_quantized_weights
    hpz: int = ZeroConfig.zero_hpz_partition_size
    qgz: bool = ZeroConfig.zero_quantized_gradients
    loco: bool = ZeroConfig.loco
    qwz_block: int = ZeroConfig.qwz_block_size
    qgz_block: int = ZeroConfig.qgz_block_size
    err_beta: float = ZeroConfig.loco_err_beta  # LoCo: weight of the old error in the blended buffer
    reset_t: int = ZeroConfig.loco_reset_t  # LoCo: buffers are zeroed after every reset_t optimizer steps
    cpu_kernels: str = ZeroConfig.cpu_quant_kernels  # kernels.CPU_KERNELS: eager torch, or compiled

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


def check_zeropp(zeropp: ZeroPP, strategy: Strategy) -> None:
    """ConfigError, naming the reason, for a ZeRO++ request the strategy gives nothing to act on."""
    if zeropp.loco and not zeropp.qgz:
        raise ConfigError(
            "zero.loco (zeropp_loco_param): LoCo corrects qgZ's 4-bit gradients; "
            "it needs zero.zero_quantized_gradients = true"
        )
    where = f"zero strategy {strategy}"
    if (zeropp.qwz or zeropp.hpz > 1) and strategy.params == Level.N:
        raise ConfigError(
            f"{where}: zero_quantized_weights / zero_hpz_partition_size act on parameter "
            f"all-gathers, and p = N keeps parameters whole on every rank (nothing is "
            f"gathered); use a strategy with p in {{I, G}}, e.g. stage 3"
        )
    if zeropp.qgz and strategy.grads == Level.N:
        raise ConfigError(
            f"{where}: zero_quantized_gradients quantizes the per-micro-batch gradient "
            f"reduction, and g = N has none (gradients are reduced once per step in the "
            f"accumulation dtype); use a strategy with g in {{I, G}}, e.g. stage 2 or 3"
        )
    check_block_size(zeropp.qwz_block)
    check_block_size(zeropp.qgz_block)
    check_err_beta(zeropp.err_beta)
    check_cpu_kernels(zeropp.cpu_kernels)
    if zeropp.reset_t < 1:
        raise ConfigError(f"zero.loco_reset_t = {zeropp.reset_t}: expected a positive step count")


def zeropp_of(z: ZeroConfig) -> ZeroPP:
    """The ZeRO++ settings of a `zero` config section (hpZ not yet fitted to the topology)."""
    return ZeroPP(
        qwz=z.zero_quantized_weights,
        hpz=z.zero_hpz_partition_size,
        qgz=z.zero_quantized_gradients,
        loco=z.loco,
        qwz_block=z.qwz_block_size,
        qgz_block=z.qgz_block_size,
        err_beta=z.loco_err_beta,
        reset_t=z.loco_reset_t,
        cpu_kernels=z.cpu_quant_kernels,
    )


def resolve_zeropp(zeropp: ZeroPP, strategy: Strategy, topology: Topology) -> ZeroPP:
    """The ZeRO++ settings this engine runs with (after `check_zeropp`).

    hpZ's group is `zeropp.hpz` consecutive DP ranks that must share a node (its point is an
    intra-node backward gather). A size above the DP ranks of one node (the ZeRO++ tutorial
    asks for 16, the GPUs of its nodes) is lowered to that count, so a config written for
    larger nodes runs unchanged; on one DP rank ZeRO++ is off (nothing crosses a link). The
    start-up banner says both, once (`megazpp.training.banner`), from the requested and the
    returned settings.
    """
    check_zeropp(zeropp, strategy)
    if not zeropp.enabled:
        return zeropp
    d = topology.dp
    if d == 1:
        return ZeroPP()
    return dataclasses.replace(zeropp, hpz=_hpz_size(zeropp.hpz, topology))


def _hpz_size(requested: int, topology: Topology) -> int:
    """hpZ's group size on `topology`: `requested` lowered to the DP ranks of one node; 1 (hpZ
    off: there is nothing inside a node to split) when a node holds one DP rank, as the
    tutorial's 16 on nodes of one rank each (`--ranks-per-node 1`)."""
    if requested <= 1:
        return 1
    dp_ranks = list(topology.dp_ranks)
    on_node = sum(1 for r in dp_ranks if topology.node_of(r) == topology.node)
    size = min(requested, on_node)
    if size == 1:
        return 1
    if len(dp_ranks) % size:
        raise ConfigError(
            f"zero.zero_hpz_partition_size = {size}: expected a divisor of the data-parallel size {len(dp_ranks)}"
        )
    for start in range(0, len(dp_ranks), size):
        nodes = {topology.node_of(r) for r in dp_ranks[start : start + size]}
        if len(nodes) > 1:
            raise ConfigError(
                f"zero.zero_hpz_partition_size = {size}: the group of DP ranks "
                f"{dp_ranks[start : start + size]} spans nodes {sorted(nodes)}; hpZ's "
                f"group must lie inside one node (use a divisor of the DP ranks per node)"
            )
    return size
