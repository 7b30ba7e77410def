"""Pipeline parallelism: the 1F1B schedule, stage p2p, tied-embedding synchronisation."""

from megazpp.parallel.pipeline.one_f_one_b import forward_backward_1f1b
from megazpp.parallel.pipeline.tied import counts_in_norm, sync_tied_embedding_grads, tied_duplicate

__all__ = ["counts_in_norm", "forward_backward_1f1b", "sync_tied_embedding_grads", "tied_duplicate"]
