"""Gather a unit's parameters right before its module runs, release them right after.

Why hooks on modules: with parameters sharded (p in {I, G}) a rank holds only its slice, and
the full tensors must exist exactly while a module computes with them: forward pre-hook
gathers, forward post-hook releases, a hook on the module's outputs re-gathers before its
backward, and the gradient hooks release once every gradient of the unit has arrived.

A parent module may read a child's parameters without calling the child (GPT-2's position
table is `self.position_embeddings.weight[:s]`), so every module with unit children also gets
hooks: in the first forward they gather all those children; afterwards only the children whose
own forward never ran, and parents left with none lose their hooks.

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
from megazpp.zero.paths import CommPaths


class ParamFetcher:
    def __init__(self, buckets: list[Bucket], paths: CommPaths,
                 modules_of: dict[int, list[nn.Module]], parents: list[tuple[nn.Module, list[Bucket]]],
                 on_backward_start: Callable[[], None]) -> None:
        self._buckets = buckets
        self.paths = paths
        self._on_backward_start = on_backward_start
        self.order: list[Bucket] = []
        self._order_done = False
        self._index: dict[int, int] = {}
        self.fetch_hook_calls = 0
        self.all_gather_calls = 0
        self._called: set[int] = set()
        self.backward_active = False
        for b in buckets:
            self.release(b)
            for module in modules_of[id(b)]:
                module.register_forward_pre_hook(self._pre_forward(b))
                module.register_forward_hook(self._post_forward(b))
        self._parent_hooks = []
        for parent, children in parents:
            handles = (parent.register_forward_pre_hook(self._parent_pre_forward(children)),
                       parent.register_forward_hook(self._parent_post_forward(children)))
            self._parent_hooks.append((children, handles))

    # -- gathering -------------------------------------------------------------------------
    def _launch(self, b: Bucket, phase: str) -> None:
        if b.full_params is None and b.fetch_pending is None:
            b.fetch_pending = self.paths.start_param_gather(b, phase)
            self.all_gather_calls += self.paths.gather_calls(phase)

    def fetch(self, b: Bucket, phase: str = "forward") -> None:
        """Make `b`'s parameters whole (waiting for a prefetch if one is in flight)."""
        if b.full_params is not None:
            return
        self._launch(b, phase)
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
            p.data = b.param_store.new_empty(0)

    def release_all(self) -> None:
        """Release every unit, dropping unused prefetches: a gather still in flight when the
        optimizer rewrites the shards would otherwise deliver pre-update values."""
        for b in self._buckets:
            self.release(b)
        self.backward_active = False

    def _prefetch(self, b: Bucket, step: int) -> None:
        if not self._order_done:
            return
        i = self._index.get(id(b))
        if i is not None and 0 <= i + step < len(self.order):
            self._launch(self.order[i + step], "forward" if step > 0 else "backward")

    # -- hooks -----------------------------------------------------------------------------
    def _pre_forward(self, b: Bucket) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.fetch_hook_calls += 1
            if not self._order_done:
                self._called.add(id(b))
                if all(u is not b for u in self.order):
                    self.order.append(b)
            # a recompute inside backward gathers as backward does (hpZ: from the secondary
            # shard) and wants no forward prefetch
            self.fetch(b, "backward" if self.backward_active else "forward")
            if not self.backward_active:
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
            self.backward_active = True
            self.fetch_hook_calls += 1
            self.fetch(b, "backward")
            self._prefetch(b, -1)
        return hook

    def _uncalled(self, children: list[Bucket]) -> list[Bucket]:
        """Children the parent must gather itself (all of them until the first forward ends)."""
        if not self._order_done:
            return children
        return [b for b in children if id(b) not in self._called]

    def _parent_pre_forward(self, children: list[Bucket]) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            todo = self._uncalled(children)
            if todo:
                self.fetch_hook_calls += 1
            for b in todo:
                self.fetch(b)
        return hook

    def _parent_post_forward(self, children: list[Bucket]) -> Callable:
        def before_backward(grad: torch.Tensor) -> None:
            todo = self._uncalled(children)
            if todo:
                self._on_backward_start()
                self.backward_active = True
                self.fetch_hook_calls += 1
            for b in todo:
                self.fetch(b, "backward")

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            todo = self._uncalled(children)
            if todo and torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(before_backward)
            for b in todo:
                self.release(b)
        return hook

    def forward_finished(self) -> None:
        """Called after the root module's forward: the execution order is now known, and so
        are the parents that never need to gather for their children."""
        if not self._order_done and self.order:
            self._order_done = True
            self._index = {id(b): i for i, b in enumerate(self.order)}
            for children, handles in self._parent_hooks:
                if not self._uncalled(children):
                    for h in handles:
                        h.remove()

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
