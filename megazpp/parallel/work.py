"""The one protocol of asynchronous operations (`Work`), and the handles `comm` builds:
finished work, works followed by a local finishing step, and work whose failure names the
operation.

Why one protocol: torch's handle of a collective, these handles, a ZeRO collective sequence in
flight (`zero.collectives.StagedWork`), a quantized gather: every consumer waits on them the
same way and asks them the same question ("would `wait()` block?") at its progress points. It
is generic in what `wait()` gives: a collective's handle gives nothing a caller uses
(`Work[object]`: torch's gives True), a ZeRO sequence its result (`Work[torch.Tensor]`).

Why apart from `comm`: an error that surfaces at `wait()` (a peer died, the timeout passed)
must name the operation, its tag and this rank as an error raised at the call does; the
handles are one job, the calls another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec, Protocol, TypeVar, cast, runtime_checkable

import torch.distributed as dist

from megazpp.errors import CommunicationError, MegazppError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")


@runtime_checkable
class Work(Protocol[T_co]):
    """An asynchronous operation in flight. `wait()` blocks until it has completed and gives
    its result; `is_completed()` says, without blocking, whether `wait()` would return at once
    (what is left then is local and cheap). A local look: ranks see completion at different
    moments, so it may decide when to act, never what is computed."""

    def wait(self) -> T_co: ...

    def is_completed(self) -> bool: ...


class Done(Work[T]):
    """Work that already finished, with its result (a world of one, an emulation done in-line,
    a reduction waited for at once)."""

    def __init__(self, result: T) -> None:
        self._result = result

    def wait(self) -> T:
        return self._result

    def is_completed(self) -> bool:
        return True


class Then(Work[T]):
    """Works followed by a local finishing step (a copy back from the host, a chunk kept), run
    once, by the first `wait()`; `wait()` gives the step's result."""

    def __init__(self, works: Sequence[Work[object]], finish: Callable[[], T]) -> None:
        self._works, self._finish, self._done = works, finish, False

    def wait(self) -> T:
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)


def failure(op: str, tag: str | None, exc: BaseException) -> CommunicationError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CommunicationError(
        f"{op} (tag {tag or op}) on rank {rank} failed: a peer rank died "
        f"or the collective timed out ({type(exc).__name__}: "
        f"{str(exc).strip()[:400]})"
    )


class NamedWork(Work[T]):
    """A handle whose `wait()` failure names the operation."""

    def __init__(self, work: Work[T], op: str, tag: str | None) -> None:
        self._work, self._op, self._tag = work, op, tag

    def wait(self) -> T:
        try:
            return self._work.wait()
        except MegazppError:
            raise
        except RuntimeError as exc:
            raise failure(self._op, self._tag, exc) from exc

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _named(result: object, op: str, tag: str | None) -> object:
    """`result` with each handle in it (one, or the list `batch_isend_irecv` returns) named."""
    if isinstance(result, list) and op == "batch_isend_irecv":
        return [NamedWork(w, op, tag) for w in result]
    if isinstance(result, Work) and not isinstance(result, Done):
        return NamedWork(result, op, tag)
    return result


def named_failures(op: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Decorate a communication function so that its backend errors (RuntimeError and its
    torch.distributed subclasses) become CommunicationError naming `op` and the tag, at the
    call and at a returned handle's `wait()` (the handle becomes a `NamedWork`, a `Work` of
    the same result)."""

    def decorate(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            given = kwargs.get("tag")
            tag = given if isinstance(given, str) else None
            try:
                result = fn(*args, **kwargs)
            except MegazppError:
                raise
            except RuntimeError as exc:
                raise failure(op, tag, exc) from exc
            return cast(T, _named(result, op, tag))

        return wrapper

    return decorate
