"""The engine's communication paths, as replaceable objects.

Why objects: ZeRO++ (quantized weights, hierarchical secondary partitions, quantized
gradients) and LoCo change HOW a bucket's parameters are gathered and its gradients reduced,
not WHEN. The engine and the fetcher only call these four methods; the exact paths here run
the `sequences` unchanged, and a compressed path replaces one of them (it may keep
per-bucket state, such as error-feedback buffers, in `Bucket.extra_state`).

Every `start_*` returns a `Work[torch.Tensor]` (`parallel/work.py`): its `wait()` gives the
resulting tensor. The remaining
methods are the engine's notifications (bucket built, step finished, parameters replaced);
the exact paths keep no state, so they have nothing to do there.
"""

from __future__ import annotations

import torch

from megazpp.parallel.work import Work
from megazpp.zero import sequences
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import PendingSequence, ZeroGroups, size_of
from megazpp.zero.strategy import Level, Strategy


class CommPaths:
    """Exact (uncompressed) paths of a strategy; `hier` picks the two-stage G collectives."""

    def __init__(self, strategy: Strategy, groups: ZeroGroups, hier: sequences.Hierarchy) -> None:
        self.strategy, self.groups, self.hier = strategy, groups, hier
        k = groups.group_size
        self._fetch = sequences.param_fetch_sequence(strategy, k, hier)
        self._micro = sequences.micro_batch_reduce_sequence(strategy, k, hier)
        self._boundary = sequences.boundary_sequence(strategy, k, hier)
        self._sync = sequences.param_sync_sequence(strategy, k, hier)
        self._sync_whole = sequences.gather_sequence(strategy.optimizer_state, Level.N, k, hier)  # persistent buckets

    def gather_calls(self, phase: str) -> int:
        """Collectives one parameter fetch issues (for the engine's statistics)."""
        return sum(1 for c in self._fetch if size_of(self.groups, c.group) > 1)

    def start_param_gather(self, b: Bucket, phase: str) -> Work[torch.Tensor]:
        """Full parameters of `b` from its p-level shard; `phase` is "forward" or "backward".
        The result is a buffer of `groups.buffers`, for the fetcher to hand back."""
        return PendingSequence(self._fetch, b.param_store, self.groups, f"zero/param_gather/{phase}")

    def start_grad_reduce(self, b: Bucket, grad: torch.Tensor) -> Work[torch.Tensor]:
        """One micro-batch's full gradient of `b` (already divided by D) down to level g; the
        reduction runs in place on `grad`."""
        return PendingSequence(self._micro, grad, self.groups, "zero/grad_reduce")

    def start_boundary(self, b: Bucket) -> Work[torch.Tensor]:
        """The accumulated g-level gradient of `b` to its full sum at level os, in place on
        `b.grad_acc` (zeroed after the step)."""
        return PendingSequence(self._boundary, b.grad_acc, self.groups, "zero/grad_boundary")

    def start_param_sync(self, b: Bucket, new_os: torch.Tensor) -> Work[torch.Tensor]:
        """Updated os-level parameters of `b` up to its p-level shard (whole when persistent)."""
        return PendingSequence(self._sync_whole if b.persistent else self._sync, new_os, self.groups, "zero/param_sync")

    def init_bucket(self, b: Bucket) -> None:
        """A bucket was built: create any per-bucket path state in `b.extra_state`."""

    def take_overflow(self) -> bool:
        """Whether this step's reductions saw a non-finite local gradient (then cleared)."""
        return False

    def after_step(self, skipped: bool, step_count: int, rescale: float) -> None:
        """The optimizer step finished (or was skipped). `rescale` takes this step's reduced
        gradient units to the next step's: the clip coefficient applied (1 on a skip) times the
        loss scale's change (new / old, fp16)."""

    def params_replaced(self) -> None:
        """Parameter shards were overwritten outside a step (a checkpoint was loaded)."""

    def state_nbytes(self) -> int:
        """Bytes of all path state this rank holds (error buffers, secondary copies)."""
        return 0
