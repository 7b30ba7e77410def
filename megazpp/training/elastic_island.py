"""Building an elastic island's engine (`outer.elastic`, docs/arch/elastic.md).

Why apart from `start_iter.build_islands`: an elastic island is its job's whole world, so its
ZeRO engine spans every rank of the job (no `island_view`), and it joins the other islands
through a `Membership` whose store is the island's node 0 (`MASTER_ADDR`, the address run.sh's
launcher was given and the other islands reach).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megazpp.config.options import RunOptions
from megazpp.errors import ConfigError, required
from megazpp.model.gpt import GPTModel
from megazpp.parallel.pipeline import counts_in_norm
from megazpp.parallel.topology import Topology
from megazpp.training.zero_factory import build_zero_engine

if TYPE_CHECKING:
    from megazpp.outer.elastic import ElasticDiLoCoEngine


def build_elastic_island(model: GPTModel, options: RunOptions, topology: Topology) -> ElasticDiLoCoEngine:
    """The ZeRO engine over this job's world inside `ElasticDiLoCoEngine` (collective: the
    membership's store port is broadcast to the island's ranks). torchft is imported here, so a
    python without it (the GPU image does not install it) runs everything else."""
    outer = required(options.outer, "outer")
    try:
        from megazpp.outer.elastic import ElasticDiLoCoEngine
        from megazpp.outer.membership import Membership
    except ImportError as exc:
        raise ConfigError(
            f"outer.elastic: this python cannot import torchft ({exc}), the membership engine of elastic "
            f"islands: pip install torchft==0.2.0 (a core dependency of the project)"
        ) from None
    inner = build_zero_engine(model, options, topology, counts_in_norm=counts_in_norm(model, topology))
    membership = Membership(
        outer.island_id,
        outer.lighthouse,
        outer.min_islands,
        topology.rank,
        topology.world_size,
        os.environ["MASTER_ADDR"],
        outer.quorum_timeout_s,
        outer.sync_timeout_s,
        inner.device,
    )
    batch = options.global_batch_size
    tokens_per_step = batch * options.config.model.seq_length
    return ElasticDiLoCoEngine(
        inner, outer, topology, membership, tokens_per_step, batch, options.train_samples, options.training.seed
    )
