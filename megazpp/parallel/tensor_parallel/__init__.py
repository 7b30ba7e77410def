"""Tensor parallelism: mappings, sharded layers, vocab-parallel loss, RNG streams."""

from megazpp.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazpp.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazpp.parallel.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megazpp.parallel.tensor_parallel.registry import param_is_tp_sharded, tp_partition_dim
from megazpp.parallel.tensor_parallel.rng import TP_REGION, RNGTracker, get_rng_tracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear",
    "RNGTracker",
    "RowParallelLinear",
    "SEQUENCE_DIM",
    "TP_REGION",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "get_rng_tracker",
    "model_parallel_seed",
    "param_is_tp_sharded",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "tp_partition_dim",
    "vocab_parallel_cross_entropy",
]
