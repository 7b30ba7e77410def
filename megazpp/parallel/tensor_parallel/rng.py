"""Named RNG streams, so dropout masks match across TP ranks where activations are
replicated and differ where each rank holds different data.

Two streams matter:
- the default torch generator, seeded identically on every TP rank of a stage: dropout on
  replicated activations (after a row-parallel all-reduce) must be the same everywhere or
  the replicas drift apart;
- `TP_REGION` ("tensor-parallel-region"), seeded with the TP rank mixed in: dropout on
  sharded activations (attention probabilities of this rank's heads, sequence-parallel
  chunks) must differ, or every shard would drop the same pattern.
`fork(name)` swaps a stream in for the duration of a block and saves where it got to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

TP_REGION = "tensor-parallel-region"
_TP_SEED_OFFSET = 2718
_PP_SEED_OFFSET = 100


class RNGTracker:
    """Holds the CPU (and, when present, CUDA) generator state of each named stream."""

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        torch.manual_seed(seed)
        self._states[name] = (torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)

    def states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Snapshot for checkpoints."""
        return dict(self._states)

    def set_states(self, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self._states = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = TP_REGION) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added (call model_parallel_seed first)")
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        mine_cpu, mine_cuda = self._states[name]
        torch.set_rng_state(mine_cpu)
        if mine_cuda is not None:
            torch.cuda.set_rng_state(mine_cuda)
        try:
            yield
        finally:
            self._states[name] = (
                torch.get_rng_state(),
                torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            )
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)


_tracker = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    return _tracker


def model_parallel_seed(seed: int, tp_rank: int = 0, pp_rank: int = 0) -> None:
    """Seed the default generator (same on all TP ranks of a stage, different per stage) and
    the TP-region stream (different on every TP rank)."""
    stage_seed = seed + _PP_SEED_OFFSET * pp_rank
    torch.manual_seed(stage_seed)
    _tracker.reset()
    _tracker.add(TP_REGION, stage_seed + _TP_SEED_OFFSET + tp_rank)
