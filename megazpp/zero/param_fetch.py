"""Gather a unit's parameters right before its module runs, release them right after.

Why hooks on modules: with parameters sharded (p in {I, G}) a rank holds only its slice, and
the full tensors must exist exactly while a module computes with them: forward pre-hook
gathers, forward post-hook releases, a hook on the module's outputs re-gathers before its
backward, and the gradient hooks release once every gradient of the unit has arrived.

Released parameters keep their `nn.Parameter` object (autograd saved it) but point at an
empty tensor; re-gathering points them at fresh views of the unit's full buffer, which the
saved references then see. The first forward records the order units run in; afterwards the
next unit (forward) or the previous one (backward) is gathered asynchronously ahead of use.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import PendingSequence, ZeroGroups
from megazpp.zero.formulas import Collective


class ParamFetcher:
    def __init__(self, buckets: list[Bucket], seq: list[Collective], groups: ZeroGroups,
                 modules_of: dict[int, list[nn.Module]], on_backward_start: Callable[[], None]) -> None:
        self._buckets = buckets
        self._seq = seq
        self._groups = groups
        self._on_backward_start = on_backward_start
        self.order: list[Bucket] = []
        self._order_done = False
        self._index: dict[int, int] = {}
        self.fetch_hook_calls = 0
        self.all_gather_calls = 0
        self._handles: list[Any] = []
        for b in buckets:
            self.release(b)
            for module in modules_of[id(b)]:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(b)))
                self._handles.append(module.register_forward_hook(self._post_forward(b)))

    # -- gathering -------------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        if b.full_params is None and b.fetch_pending is None:
            b.fetch_pending = PendingSequence(self._seq, b.param_store, self._groups, "zero/param_gather")
            self.all_gather_calls += len(self._seq)

    def fetch(self, b: Bucket) -> None:
        """Make `b`'s parameters whole (waiting for a prefetch if one is in flight)."""
        if b.full_params is not None:
            return
        self._launch(b)
        full = b.fetch_pending.wait()
        b.fetch_pending = None
        b.full_params = full
        b.layout.view_params_into(full)

    def release(self, b: Bucket) -> None:
        if b.fetch_pending is not None:  # a prefetch nobody used: finish it so ranks stay in step
            b.fetch_pending.wait()
            b.fetch_pending = None
        b.full_params = None
        for p in b.layout.params:
            p.data = torch.empty(0, dtype=b.param_store.dtype)

    def release_all(self) -> None:
        for b in self._buckets:
            self.release(b)

    def _prefetch(self, b: Bucket, step: int) -> None:
        if not self._order_done:
            return
        i = self._index.get(id(b))
        if i is not None and 0 <= i + step < len(self.order):
            self._launch(self.order[i + step])

    # -- hooks -----------------------------------------------------------------------------
    def _pre_forward(self, b: Bucket) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.fetch_hook_calls += 1
            if not self._order_done and all(u is not b for u in self.order):
                self.order.append(b)
            self.fetch(b)
            self._prefetch(b, +1)
        return hook

    def _post_forward(self, b: Bucket) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(b))
            self.release(b)
        return hook

    def _pre_backward(self, b: Bucket) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self._on_backward_start()
            self.fetch_hook_calls += 1
            self.fetch(b)
            self._prefetch(b, -1)
        return hook

    def forward_finished(self) -> None:
        """Called after the root module's forward: the execution order is now known."""
        if not self._order_done and self.order:
            self._order_done = True
            self._index = {id(b): i for i, b in enumerate(self.order)}

    def reset_stats(self) -> None:
        self.fetch_hook_calls = 0
        self.all_gather_calls = 0


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
