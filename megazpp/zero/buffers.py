"""Flat buffers the ZeRO engine hands back for reuse: gather outputs and gradient staging.

Why: a fresh tensor of a few MB is fresh pages from the operating system, and a first touch
costs a page fault per 4 KiB page. On the machines we measure (virtual machines) those faults
cost more than the copy into the buffer, so a gather or a staging buffer allocated anew every
micro-batch spends most of its time faulting pages in. A buffer handed back is handed out again
to the next request of the same size, dtype and device. Only buffers the pool handed out are
taken back, so it holds what was in use at once, plus one for each take that came while a
returned buffer was still held by a finished collective's thread.
"""

from __future__ import annotations

import weakref

import torch

Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Free flat buffers by (elements, dtype, device), and which handed-out buffers may return."""

    def __init__(self) -> None:
        self._free: dict[Key, list[torch.Tensor]] = {}
        # id -> buffer handed out and not yet back; weak, so a buffer its user drops is not kept
        self._out: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._shared: list[torch.Tensor] = []  # handed back while other tensors still share them
        self.allocations = 0  # buffers made, not reused

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat buffer of `numel` elements of `like`'s dtype and device (contents undefined)."""
        self._reclaim()
        free = self._free.get((numel, like.dtype, like.device))
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.allocations += 1
        self._out[id(buffer)] = buffer
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Hand `buffer` back. It is handed out again only once no other tensor shares its memory
        (a view autograd saved for a backward still to come, a caller's detached parameter, a
        finished collective the backend's thread has not let go of yet); until then it waits
        in `_shared`. A tensor this pool did not hand out (a view, a decoded gather) is left
        alone."""
        if self._out.pop(id(buffer), None) is buffer:
            self._shared.append(buffer)
            self._reclaim()

    def _reclaim(self) -> None:
        still = []
        for buffer in self._shared:
            if _sharers(buffer) == 0:
                self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)
            else:
                still.append(buffer)
        self._shared = still

    def held(self) -> int:
        """Buffers back in the pool, free or waiting for their sharers (between steps, every
        buffer the engine took: one fewer than `allocations` is a buffer it never gave back)."""
        return sum(len(ts) for ts in self._free.values()) + len(self._shared)


def _sharers(t: torch.Tensor) -> int:
    """Other tensors holding `t`'s storage (the count includes `t` and the handle made here)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 2
