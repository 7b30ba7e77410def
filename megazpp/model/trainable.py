"""Which parameters train: `training.trainable` name patterns, LoRA adapters, or everything.

Why by name: a parameter's global name is the same in every parallel layout (`gpt.py`), so
one pattern list selects the same parameters on every TP rank and pipeline stage. A pattern is
an `fnmatch` glob over those names (`*norm*`, `*.bias`, `layers.7.*`) or `last:N`, the last N
transformer layers. Each pattern must match a parameter of the whole model (not only of this
stage): a typo would otherwise silently freeze what the user meant to train.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import EMBEDDING_WEIGHT, GPTModel
from megazpp.model.lora import is_adapter

# the last stage's copy of a tied embedding (pipeline) trains exactly when the embedding does
TIED_COPY = "output_layer.weight"


def _expand(pattern: str, num_layers: int) -> list[str]:
    if not pattern.startswith("last:"):
        return [pattern]
    count = pattern[len("last:") :]
    if not count.isdigit() or not 1 <= int(count) <= num_layers:
        raise ConfigError(
            f"training.trainable = {pattern!r}: expected last:N with N in [1, model.num_layers = {num_layers}]"
        )
    return [f"layers.{i}.*" for i in range(num_layers - int(count), num_layers)]


def whole_model_names(cfg: ModelConfig) -> list[str]:
    """Parameter names of the whole model (every stage), from a model on the meta device."""
    with torch.device("meta"):
        return [n for n, _ in GPTModel(cfg).named_parameters()]


def trainable_rule(patterns: list[str], cfg: ModelConfig) -> TrainableRule:
    """Check `patterns` against the whole model and return the rule they make."""
    globs = [g for p in patterns for g in _expand(p, cfg.num_layers)]
    names = whole_model_names(cfg) if patterns else []
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, g) for g in _expand(pattern, cfg.num_layers) for n in names):
            raise ConfigError(
                f"training.trainable = {pattern!r}: matches no parameter of the model "
                f"(names look like {names[0]!r}, {names[-1]!r})"
            )
    return TrainableRule(globs, cfg.lora_rank > 0, bool(cfg.tie_embeddings))


class TrainableRule:
    """Adapters (when LoRA is on) and parameters matching a glob train; with neither,
    everything trains."""

    def __init__(self, globs: list[str], adapters: bool, tied: bool) -> None:
        self.globs, self.adapters, self.tied = globs, adapters, tied

    def trains(self, name: str) -> bool:
        if self.tied and name == TIED_COPY:
            name = EMBEDDING_WEIGHT
        return (
            (not self.globs and not self.adapters)
            or (self.adapters and is_adapter(name))
            or any(fnmatch.fnmatchcase(name, g) for g in self.globs)
        )


def apply_trainable(model: nn.Module, patterns: list[str], cfg: ModelConfig) -> int:
    """Freeze what `patterns` (and LoRA) leave out; return this stage's trainable elements.
    A stage left with nothing to train is refused (its engine would have no optimizer state
    and the pipeline's gradient-norm reduction would wait for it)."""
    rule = trainable_rule(patterns, cfg)
    count = 0
    for name, p in model.named_parameters():
        p.requires_grad_(rule.trains(name))
        count += p.numel() if p.requires_grad else 0
    if count == 0:
        layers = [n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("layers.")]
        where = f"layers {layers[0]}..{layers[-1]}" if layers else "no layers"
        raise ConfigError(
            f"training.trainable = {patterns!r}: selects no parameter of this pipeline "
            f"stage ({where}); every stage needs one (or use fewer stages)"
        )
    return count


def trainable_fraction(cfg: ModelConfig, patterns: list[str]) -> float:
    """Trainable share of the whole model's parameter elements (the planner's PEFT input)."""
    rule = trainable_rule(patterns, cfg)
    with torch.device("meta"):
        sizes = [(n, p.numel()) for n, p in GPTModel(cfg).named_parameters()]
    return sum(n for name, n in sizes if rule.trains(name)) / sum(n for _, n in sizes)
