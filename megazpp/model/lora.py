"""LoRA adapters on a built model, and merging them back into the base weights.

Why after construction: the adapters change no existing name (`layers.3.attention.qkv.weight`
stays what it was, the adapter adds `...qkv.lora.a` / `...qkv.lora.b`), so checkpoints of the
base model, the Hugging Face converter and the layout-independent init keep working; the
tensor-parallel split of the factors is the linear's business (`tensor_parallel/lora.py`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megazpp.errors import required
from megazpp.model.config import ModelConfig
from megazpp.model.init import normal_init
from megazpp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

ADAPTER_SUFFIXES = (".lora.a", ".lora.b")


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def add_adapters(model: nn.Module, cfg: ModelConfig) -> int:
    """Give every linear named in `cfg.lora_targets` inside the transformer layers a rank
    `cfg.lora_rank` adapter; return how many were added (0 when lora_rank is 0)."""
    if cfg.lora_rank == 0:
        return 0
    added = 0
    for name, module in model.named_modules():
        if (
            isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            and name.startswith("layers.")
            and name.rsplit(".", 1)[-1] in required(cfg.lora_targets, "model.lora_targets")
        ):
            a = torch.empty(cfg.lora_rank, module.in_features, device=module.weight.device)
            normal_init(cfg.init_seed, f"{name}.lora.a", 1.0 / math.sqrt(module.in_features))(a)
            module.add_adapter(cfg.lora_rank, cfg.lora_alpha, a)
            added += 1
    return added


def merge_adapters(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (unsplit) weights with every adapter folded into its base weight,
    W + (alpha / r) B A, computed in fp32 and stored in W's dtype; the adapter entries are gone."""
    merged = {k: v for k, v in weights.items() if not is_adapter(k)}
    for key in weights:
        if key.endswith(".lora.a"):
            base = key[: -len(".lora.a")]
            a, b = weights[key].float(), weights[f"{base}.lora.b"].float()
            w = merged[f"{base}.weight"]
            merged[f"{base}.weight"] = (w.float() + (cfg.lora_alpha / cfg.lora_rank) * (b @ a)).to(w.dtype)
    return merged
