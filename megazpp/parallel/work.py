"""Handles of asynchronous communication: finished work, work with a finishing step, and
work whose failure names the operation.

Why apart from `comm`: the collectives there return these, and an error that surfaces at
`wait()` (a peer died, the timeout passed) must name the operation, its tag and this rank as an
error raised at the call does; the handles are one job, the calls another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from megazpp.errors import CommunicationError, MegazppError


class Done:
    """Waitable for work that already finished (local world, emulations done in-line)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Then:
    """Waitable that runs a finishing step after the underlying work completes."""

    def __init__(self, work: Any, finish: Any) -> None:
        self._work, self._finish, self._done = work, finish, False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if not self._done:
            self._work.wait()
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether `wait()` would not block (the finishing step itself is cheap and local)."""
        return self._done or self._work.is_completed()


def failure(op: str, tag: str | None, exc: BaseException) -> CommunicationError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CommunicationError(
        f"{op} (tag {tag or op}) on rank {rank} failed: a peer rank died "
        f"or the collective timed out ({type(exc).__name__}: "
        f"{str(exc).strip()[:400]})"
    )


class NamedWork:
    """An asynchronous handle whose `wait()` failure names the operation."""

    def __init__(self, work: Any, op: str, tag: str | None) -> None:
        self._work, self._op, self._tag = work, op, tag

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        except MegazppError:
            raise
        except RuntimeError as exc:
            raise failure(self._op, self._tag, exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_F = TypeVar("_F", bound=Callable[..., Any])


def named_failures(op: str) -> Callable[[_F], _F]:
    """Decorate a communication function so that its backend errors (RuntimeError and its
    torch.distributed subclasses) become CommunicationError naming `op` and the tag."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tag = kwargs.get("tag")
            try:
                result = fn(*args, **kwargs)
            except MegazppError:
                raise
            except RuntimeError as exc:
                raise failure(op, tag, exc) from exc
            if isinstance(result, list) and op == "batch_isend_irecv":
                return [NamedWork(w, op, tag) for w in result]
            if result is not None and hasattr(result, "wait") and not isinstance(result, Done):
                return NamedWork(result, op, tag)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate
