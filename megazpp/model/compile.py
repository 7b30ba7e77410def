"""`training.compile`: each transformer layer's forward compiled by `torch.compile`.

Why per layer: the layers are where the time goes and are all alike, so one compiled graph
serves them all (TorchInductor fuses norms, rotary, activations and residual adds into a few
loops); the embedding, the loss and the engine's collectives stay eager. Why the bound
`forward` of each layer instance rather than wrapping the module: parameter names, state dicts,
checkpoints and the ZeRO engine's module hooks (which gather and release parameters around the
call, outside the compiled code) stay exactly as without compilation, and activation
checkpointing still wraps the whole layer call.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_compiled import separate_cache_per_isa


def compile_layers(layers: nn.ModuleDict) -> int:
    """Compile the forward of every layer in `layers` (in place); returns how many. Inductor's
    disk cache is kept per vector ISA first (a CPU kernel of another ISA read back is wrong)."""
    separate_cache_per_isa()
    for layer in layers.values():
        layer.forward = torch.compile(layer.forward)
    return len(layers)
