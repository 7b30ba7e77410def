"""Parameter initialisation that depends only on (seed, parameter's global name).

A tensor- or pipeline-parallel rank builds only part of the model, in its own order, so a
shared random stream would give each layout different weights. Instead every weight draws
from its own generator, seeded by a stable hash (sha256, not Python's salted `hash`) of the
seed and the parameter's global name; the tensor-parallel layers apply the init to the FULL
weight before keeping their shard. Any layout therefore starts from the single-process
model's weights, which is what lets parallel runs be compared to it number for number.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], None]


def name_seed(init_seed: int, name: str) -> int:
    """A 63-bit generator seed from the model seed and a parameter's global name."""
    digest = hashlib.sha256(f"{init_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_init(init_seed: int, name: str, std: float) -> InitMethod:
    """An in-place N(0, std) init for the full weight called `name`.

    The values are drawn on the CPU in fp32 and then copied, so they are the same on every
    device and for every parameter dtype.
    """

    def init(weight: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(name_seed(init_seed, name))
        values = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        with torch.no_grad():
            weight.copy_(values)

    return init


def scaled_std(init_std: float, num_layers: int) -> float:
    """Std of the projections that write into the residual stream (attention out, MLP down):
    std / sqrt(2 * num_layers), as in GPT-2 and Megatron, so the residual's variance does not
    grow with depth (two such writes per layer)."""
    return init_std / math.sqrt(2.0 * num_layers)


class Initializer:
    """Hands each layer the init method for one of its weights, by global name.

    Layers call `normal(name)` for weights that read from the residual stream and `scaled(name)`
    for those that write into it; `name` is the parameter's global name in the single-process
    model (e.g. "layers.3.attention.out.weight"), whatever this rank builds.
    """

    def __init__(self, init_seed: int, init_std: float, num_layers: int) -> None:
        self.init_seed = init_seed
        self.init_std = init_std
        self.output_std = scaled_std(init_std, num_layers)

    def normal(self, name: str) -> InitMethod:
        return normal_init(self.init_seed, name, self.init_std)

    def scaled(self, name: str) -> InitMethod:
        return normal_init(self.init_seed, name, self.output_std)
