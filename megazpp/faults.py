"""Fault injection for reliability tests: explicit, named points that fire only when asked.

Why in the product code: the failures worth testing (a rank killed mid-run, a crash between
two ranks' checkpoint writes, a crash before `latest` moves, a NaN loss) happen at precise
places inside the trainer; injecting them from outside would need timing luck. Each point is
one call that does nothing unless the environment variable `MEGAZPP_FAULT` names it, so a
normal run (the variable unset) can never trigger one.

`MEGAZPP_FAULT` is a comma-separated list of `POINT@ITERATIONS[:RANK]`, ITERATIONS being `N`
or an inclusive range `N-M`, RANK a global rank (without it every rank fires):

    kill_after_step       SIGKILL this process right after optimizer step ITERATION
    sigterm_after_step    send this process SIGTERM right after optimizer step ITERATION
                          (what a scheduler does; the trainer saves and stops)
    raise_after_rank_file checkpoint ITERATION: raise InjectedFault after this rank's file
                          is written, before the other ranks meet (a crash between shards)
    raise_before_latest   checkpoint ITERATION: raise InjectedFault after the directory is
                          renamed, before the `latest` pointer is replaced
    nan_loss              the model's output (hence loss and gradients) is NaN at ITERATION
    loss_spike            the model's output (hence the loss) is 10x at ITERATION

A fault fires only in the first attempt of a torchrun job (`TORCHELASTIC_RESTART_COUNT`
unset or 0), so a restarted job runs clean, as it would after a real transient failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator

import torch
from torch import nn

from megazpp.errors import ConfigError

ENV = "MEGAZPP_FAULT"
POINTS = (
    "kill_after_step",
    "sigterm_after_step",
    "raise_after_rank_file",
    "raise_before_latest",
    "nan_loss",
    "loss_spike",
)
_OUTPUT_FACTORS = {"nan_loss": float("nan"), "loss_spike": 10.0}


class InjectedFault(RuntimeError):
    """Raised by an injection point; never by anything else."""


_ITEM = re.compile(r"^(\w+)@(\d+)(?:-(\d+))?(?::(\d+))?$")


def _parse(spec: str) -> list[tuple[str, range, int | None]]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _ITEM.match(item)
        if match is None or match[1] not in POINTS:
            raise ConfigError(
                f"{ENV} = {spec!r}: expected POINT@N[-M][:RANK] items with POINT one of {list(POINTS)}, got {item!r}"
            )
        first = int(match[2])
        last = int(match[3]) if match[3] else first
        faults.append((match[1], range(first, last + 1), int(match[4]) if match[4] else None))
    return faults


def armed(point: str, iteration: int, rank: int) -> bool:
    """True when `MEGAZPP_FAULT` asks for `point` at `iteration` on `rank` in this attempt."""
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return any(p == point and iteration in its and r in (None, rank) for p, its, r in _parse(spec))


def check_spec() -> None:
    """Refuse a malformed `MEGAZPP_FAULT` at start-up rather than at the step it names."""
    spec = os.environ.get(ENV)
    if spec:
        _parse(spec)


def maybe_raise(point: str, iteration: int, rank: int) -> None:
    if armed(point, iteration, rank):
        raise InjectedFault(f"injected fault {point} at iteration {iteration} on rank {rank}")


def maybe_kill(iteration: int, rank: int) -> None:
    if armed("kill_after_step", iteration, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_signal(iteration: int, rank: int) -> None:
    if armed("sigterm_after_step", iteration, rank):
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def poisoned_output(model: nn.Module, iteration: int, rank: int) -> Iterator[None]:
    """While active, at an armed `nan_loss` / `loss_spike` iteration, every forward output of
    `model` is multiplied by NaN / 10, as a diverging model or a bad batch would make it."""
    factors = [f for point, f in _OUTPUT_FACTORS.items() if armed(point, iteration, rank)]
    if not factors:
        yield
        return

    def poison(_module: nn.Module, _inputs: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        return output * factors[0]

    handle = model.register_forward_hook(poison)
    try:
        yield
    finally:
        handle.remove()
