"""Check a ZeRO++ request against the strategy and the topology, and settle hpZ's group size.

Why refusals here: each ZeRO++ path replaces one collective of the strategy, so it only means
something where that collective exists. qwZ and hpZ act on parameter gathers (p in {I, G});
qgZ on the per-micro-batch gradient reduction (g in {I, G}); LoCo corrects qgZ's 4-bit
gradients. Anything else would be a switch that silently does nothing, so it is refused.
"""

from __future__ import annotations

import dataclasses
import logging

from kernels.api import check_cpu_kernels
from kernels.format import check_block_size, check_err_beta
from megazpp.config import ZeroConfig
from megazpp.errors import ConfigError
from megazpp.parallel.topology import Topology
from megazpp.zero.formulas import ZeroPP
from megazpp.zero.strategy import Level, Strategy

log = logging.getLogger(__name__)


def check_zeropp(zeropp: ZeroPP, strategy: Strategy) -> None:
    """ConfigError, naming the reason, for a ZeRO++ request the strategy gives nothing to act on."""
    if zeropp.loco and not zeropp.qgz:
        raise ConfigError("zero.loco (zeropp_loco_param): LoCo corrects qgZ's 4-bit gradients; "
                          "it needs zero.zero_quantized_gradients = true")
    where = f"zero strategy {strategy}"
    if (zeropp.qwz or zeropp.hpz > 1) and strategy.p == Level.N:
        raise ConfigError(f"{where}: zero_quantized_weights / zero_hpz_partition_size act on parameter "
                          f"all-gathers, and p = N keeps parameters whole on every rank (nothing is "
                          f"gathered); use a strategy with p in {{I, G}}, e.g. stage 3")
    if zeropp.qgz and strategy.g == Level.N:
        raise ConfigError(f"{where}: zero_quantized_gradients quantizes the per-micro-batch gradient "
                          f"reduction, and g = N has none (gradients are reduced once per step in the "
                          f"accumulation dtype); use a strategy with g in {{I, G}}, e.g. stage 2 or 3")
    check_block_size(zeropp.qwz_block)
    check_block_size(zeropp.qgz_block)
    check_err_beta(zeropp.err_beta)
    check_cpu_kernels(zeropp.cpu_kernels)
    if zeropp.reset_t < 1:
        raise ConfigError(f"zero.loco_reset_t = {zeropp.reset_t}: expected a positive step count")


def zeropp_of(z: ZeroConfig) -> ZeroPP:
    """The ZeRO++ settings of a `zero` config section (hpZ not yet fitted to the topology)."""
    return ZeroPP(qwz=z.zero_quantized_weights, hpz=z.zero_hpz_partition_size, qgz=z.zero_quantized_gradients,
                  loco=z.loco, qwz_block=z.qwz_block_size, qgz_block=z.qgz_block_size, err_beta=z.loco_err_beta,
                  reset_t=z.loco_reset_t, cpu_kernels=z.cpu_quant_kernels)


def resolve_zeropp(zeropp: ZeroPP, strategy: Strategy, topology: Topology) -> ZeroPP:
    """The ZeRO++ settings this engine runs with (after `check_zeropp`).

    hpZ's group is `zeropp.hpz` consecutive DP ranks that must share a node (its point is an
    intra-node backward gather). A size above the DP ranks of one node (the ZeRO++ tutorial
    asks for 16, the GPUs of its nodes) is lowered to that count, with a warning, so a config
    written for larger nodes runs unchanged.
    """
    check_zeropp(zeropp, strategy)
    if not zeropp.enabled:
        return zeropp
    d = topology.dp
    if d == 1:
        log.warning("zero: ZeRO++ requested with a single data-parallel rank: no parameter or "
                    "gradient crosses a link, so there is nothing to compress; running exact paths")
        return ZeroPP()
    return dataclasses.replace(zeropp, hpz=_hpz_size(zeropp.hpz, topology))


def _hpz_size(requested: int, topology: Topology) -> int:
    if requested <= 1:
        return 1
    dp_ranks = list(topology.dp_ranks)
    on_node = sum(1 for r in dp_ranks if topology.node_of(r) == topology.node)
    size = requested
    if requested > on_node:
        log.warning("zero: zero_hpz_partition_size = %d exceeds the %d data-parallel ranks of one node; "
                    "using %d (hpZ's secondary partition must stay inside a node)",
                    requested, on_node, on_node)
        size = on_node
    if size == 1:
        raise ConfigError(f"zero.zero_hpz_partition_size = {requested}: each node holds one data-parallel "
                          f"rank, so an intra-node secondary partition cannot be split; set it to 1")
    if len(dp_ranks) % size:
        raise ConfigError(f"zero.zero_hpz_partition_size = {size}: expected a divisor of the "
                          f"data-parallel size {len(dp_ranks)}")
    for start in range(0, len(dp_ranks), size):
        nodes = {topology.node_of(r) for r in dp_ranks[start:start + size]}
        if len(nodes) > 1:
            raise ConfigError(f"zero.zero_hpz_partition_size = {size}: the group of DP ranks "
                              f"{dp_ranks[start:start + size]} spans nodes {sorted(nodes)}; hpZ's "
                              f"group must lie inside one node (use a divisor of the DP ranks per node)")
    return size
