"""Every global RNG a step may draw from, as a rank file holds it (and as evaluation sets it
aside so that it does not shift the training dropout stream)."""

from __future__ import annotations

import random
from typing import TypedDict, cast

import numpy as np
import torch
from torch import Tensor

from megazpp.parallel.tensor_parallel import get_rng_tracker


class NumpyRNGState(TypedDict):
    """NumPy's legacy state tuple with its keys as a tensor (what `weights_only` loads)."""

    kind: str
    keys: Tensor
    pos: int
    has_gauss: int
    cached_gaussian: float


class RNGState(TypedDict):
    """A rank file's "rng" entry."""

    python: tuple[int, tuple[int, ...], float | None]  # random.getstate()
    numpy: NumpyRNGState
    torch: Tensor
    cuda: list[Tensor]  # one per visible GPU; empty without CUDA
    tp_streams: dict[str, tuple[Tensor, Tensor | None]]  # the tensor-parallel RNG tracker's


def capture_rng_state() -> RNGState:
    """Every global RNG a step may draw from, in a form `weights_only` loading accepts."""
    # legacy=True (the default) returns the tuple form
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tp_streams": get_rng_tracker().states(),
    }


def restore_rng_state(state: RNGState) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tp_streams"])
