"""Gather a fetch group's parameters when one of its units' modules runs; keep or release them.

Why hooks on modules: with parameters sharded (p in {I, G}) a rank holds only its slice, and
the full tensors must exist while a module computes with them. A fetch group (one flat buffer,
`units.fetch_groups`) is gathered by one collective per stage when the first of its units'
modules starts; it has finished its forward when none of its modules is running any more, and
is released when the forward moves on to another group (or ends), unless it is kept
(`traffic.reuse_mask`: DeepSpeed's `stage3_max_live_parameters` / `stage3_max_reuse_distance`).
A kept group stays gathered from its first forward of a step to the optimizer step: its
backward, and every later micro-batch's forward and backward, find it gathered. That holds no
more than the start of each backward already does, where every kept group is gathered (and it
covers 1F1B, whose forwards run ahead of their backwards). A hook on each unit's outputs
gathers a group not kept again before its backward; the gradient hooks release it once every
gradient of the group has arrived. A forward that runs inside backward (the recompute of a
checkpointed layer) never releases: its group's backward comes next, so the recompute reuses
what is gathered and a group is fetched at most twice per micro-batch, checkpointed or not.

A parent module may read a child's parameters without calling the child (GPT-2's position
table is `self.position_embeddings.weight[:s]`), so every module with unit children also gets
hooks: in the first forward they gather all those children; afterwards only the children whose
own forward never ran, and parents left with none lose their hooks.

Released parameters keep their `nn.Parameter` object (autograd saved it) but point at an
empty tensor; re-gathering points them at fresh views of the group's full buffer, which the
saved references then see. The first forward records the order groups run in; afterwards the
next groups (forward) or the previous ones (backward) are gathered asynchronously ahead of use,
as many as fit `stage3_prefetch_bucket_size` elements. Each unit's hook is also a progress
point: the later stages of collectives whose earlier stage has completed start there
(`collectives.StageOrder`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megazpp.zero.bucket import Bucket
from megazpp.zero.paths import CommPaths

# module hooks: (module, its positional inputs) before forward, and their output after it
PreHook = Callable[[nn.Module, tuple[object, ...]], None]
PostHook = Callable[[nn.Module, tuple[object, ...], object], None]


class ParamFetcher:
    """`keep[id(b)]`: group b stays gathered from its forward to its backward; `prefetch_numel`:
    elements of the groups ahead that may be gathering at once (0: no prefetch)."""

    def __init__(
        self,
        buckets: list[Bucket],
        paths: CommPaths,
        modules_of: dict[int, list[nn.Module]],
        parents: list[tuple[nn.Module, list[tuple[nn.Module, Bucket]]]],
        on_backward_start: Callable[[], None],
        keep: dict[int, bool],
        prefetch_numel: int,
    ) -> None:
        self._buckets = buckets
        self.paths = paths
        self._on_backward_start = on_backward_start
        self._keep = keep
        self._prefetch_numel = prefetch_numel
        self.order: list[Bucket] = []
        self._order_done = False
        self._index: dict[int, int] = {}
        self.fetch_hook_calls = 0
        self.all_gather_calls = 0
        self._called: set[int] = set()  # unit roots whose own forward ran
        self._running: dict[int, int] = {}  # group -> its modules whose forward is running
        self._finished: dict[int, Bucket] = {}  # forward done, released when the forward moves on
        self.backward_active = False
        self._hooks: list[RemovableHandle] = []  # every module hook, removed by `close`
        for b in buckets:
            self.release(b)
            for module in modules_of[id(b)]:
                self._hooks += [
                    module.register_forward_pre_hook(self._pre_forward(b, module)),
                    module.register_forward_hook(self._post_forward(b)),
                ]
        self._parent_hooks = []
        for parent, children in parents:
            handles = (
                parent.register_forward_pre_hook(self._parent_pre_forward(children)),
                parent.register_forward_hook(self._parent_post_forward(children)),
            )
            self._parent_hooks.append((children, handles))
            self._hooks += handles

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
        if b.fetch_pending is None:
            raise RuntimeError("a parameter fetch was launched but left nothing to wait for")
        full = b.fetch_pending.wait()
        b.fetch_pending = None
        b.full_params = full
        b.layout.view_params_into(full)

    def release(self, b: Bucket) -> None:
        """Drop `b`'s full parameters; their buffer goes back to the pool for the next gather
        when nothing else holds it (`buffers.BufferPool.give`)."""
        if b.fetch_pending is not None:  # a prefetch nobody used: finish it so ranks stay in step
            self.paths.groups.buffers.give(b.fetch_pending.wait())
            b.fetch_pending = None
        full, b.full_params = b.full_params, None
        self._finished.pop(id(b), None)
        for p in b.layout.params:
            p.data = b.param_store.new_empty(0)
        if full is not None:
            self.paths.groups.buffers.give(full)

    def release_all(self) -> None:
        """Release every group, dropping unused prefetches: a gather still in flight when the
        optimizer rewrites the shards would otherwise deliver pre-update values."""
        for b in self._buckets:
            self.release(b)
        self._running.clear()
        self.backward_active = False

    def close(self) -> None:
        """Finish every gather in flight (a prefetch the last forward started), release every
        group and remove the module hooks, so that nothing of this fetcher stays reachable
        from the model. The sharded parameters are left empty: the engine is done."""
        self.release_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def gradients_done(self, b: Bucket) -> None:
        """All of `b`'s gradients of one backward are in: that backward no longer needs it. A
        kept group stays gathered for the next micro-batch's forward and backward, to the step."""
        if not self._keep[id(b)]:
            self.release(b)

    def backward_finished(self) -> None:
        """End of one backward: release what it gathered, except kept groups (frozen ones too:
        having no gradients to report, they would otherwise be released only here)."""
        for b in self._buckets:
            if not self._keep[id(b)]:
                self.release(b)
        self._running.clear()
        self.backward_active = False

    def _prefetch(self, b: Bucket, step: int) -> None:
        """Gather the groups after (step +1) or before (-1) `b` in the recorded order, as many
        as fit the prefetch budget (groups already gathered cost nothing and do not count)."""
        if not self._order_done or id(b) not in self._index:
            return
        budget = self._prefetch_numel
        i = self._index[id(b)] + step
        while 0 <= i < len(self.order):
            ahead = self.order[i]
            if ahead.full_params is None:
                budget -= ahead.layout.padded
                if budget < 0:
                    return
                self._launch(ahead, "forward" if step > 0 else "backward")
            i += step

    # -- the forward's group boundaries ----------------------------------------------------
    def _enter(self, b: Bucket) -> None:
        """A module of `b` starts its forward (outside backward): groups whose forward is over
        and that are not kept are released now that the forward has moved on."""
        if self.backward_active:
            return
        self._running[id(b)] = self._running.get(id(b), 0) + 1
        self._finished.pop(id(b), None)
        for other in list(self._finished.values()):
            self.release(other)

    def _exit(self, b: Bucket) -> None:
        if self.backward_active:
            return
        self._running[id(b)] -= 1
        if self._running[id(b)] == 0:
            if not (torch.is_grad_enabled() and self._keep[id(b)]):  # a kept group stays to the step
                self._finished[id(b)] = b

    # -- hooks -----------------------------------------------------------------------------
    def _pre_forward(self, b: Bucket, module: nn.Module) -> PreHook:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            self.fetch_hook_calls += 1
            self.paths.groups.order.progress()
            if not self._order_done:
                self._called.add(id(module))
                if all(u is not b for u in self.order):
                    self.order.append(b)
            self._enter(b)
            # a recompute inside backward gathers as backward does (hpZ: from the secondary
            # shard) and wants no forward prefetch
            self.fetch(b, "backward" if self.backward_active else "forward")
            if not self.backward_active:
                self._prefetch(b, +1)

        return hook

    def _post_forward(self, b: Bucket) -> PostHook:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(b))
            self._exit(b)

        return hook

    def _pre_backward(self, b: Bucket) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._on_backward_start()
            self.backward_active = True
            self.fetch_hook_calls += 1
            self.paths.groups.order.progress()
            self.fetch(b, "backward")
            self._prefetch(b, -1)

        return hook

    def _uncalled(self, children: list[tuple[nn.Module, Bucket]]) -> list[Bucket]:
        """Groups of the children the parent must gather itself: all of them until the first
        forward ends, then those of children whose own forward never ran (the parent reads
        their parameters directly, so no hook of theirs gathers them before backward)."""
        todo: list[Bucket] = []
        for child, b in children:
            if (not self._order_done or id(child) not in self._called) and all(b is not t for t in todo):
                todo.append(b)
        return todo

    def _parent_pre_forward(self, children: list[tuple[nn.Module, Bucket]]) -> PreHook:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            todo = self._uncalled(children)
            if todo:
                self.fetch_hook_calls += 1
            for b in todo:
                self._enter(b)
                self.fetch(b, "backward" if self.backward_active else "forward")

        return hook

    def _parent_post_forward(self, children: list[tuple[nn.Module, Bucket]]) -> PostHook:
        def before_backward(grad: torch.Tensor) -> None:
            todo = self._uncalled(children)
            if todo:
                self._on_backward_start()
                self.backward_active = True
                self.fetch_hook_calls += 1
            for b in todo:
                self.fetch(b, "backward")

        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            todo = self._uncalled(children)
            if todo and torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(before_backward)
            for b in todo:
                self._exit(b)

        return hook

    def forward_finished(self) -> None:
        """Called after the root module's forward: groups not kept for backward are released;
        the first time, the execution order is now known, and so are the parents that never
        need to gather for their children."""
        if self.backward_active:
            return
        for b in list(self._finished.values()):
            self.release(b)
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


def _tensors(output: object) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
