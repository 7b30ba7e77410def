"""Which parameters travel together: parameter units (p sharded) and gradient buckets (p = N).

Why units follow modules: a unit is gathered right before its module runs and released right
after, so it must be a module subtree. `module_granularity_threshold` (DeepSpeed's
`stage3_module_granularity_threshold`) merges fine-grained subtrees: a module whose parameter
count divided by (1 + its number of descendant modules) is below the threshold becomes one
unit with its whole subtree, so a layer of 64 three-linear experts costs one fetch hook and
one all-gather instead of 197. Threshold 0 gives one unit per module that owns parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class ParamGroupSpec:
    """Parameters that share one flat buffer; `module` is where its fetch hooks go (or None)."""

    name: str
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    module: nn.Module | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def _subtree_stats(module: nn.Module) -> tuple[int, int]:
    """(trainable parameter elements in the subtree, number of descendant modules)."""
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    descendants = sum(1 for _ in module.modules()) - 1
    return numel, descendants


def is_fine_grained(module: nn.Module, threshold: int) -> bool:
    numel, descendants = _subtree_stats(module)
    return numel > 0 and numel / (1 + descendants) < threshold


def parameter_units(model: nn.Module, threshold: int) -> list[ParamGroupSpec]:
    """Units in module-registration order (the recorded execution order refines prefetch)."""
    units: list[ParamGroupSpec] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if is_fine_grained(module, threshold):
            unit = ParamGroupSpec(name or "<root>", module=module)
            for pname, p in module.named_parameters(prefix=name):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    unit.params.append((pname, p))
            if unit.params:
                units.append(unit)
            return
        own = ParamGroupSpec(name or "<root>", module=module)
        for pname, p in module.named_parameters(prefix=name, recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                own.params.append((pname, p))
        if own.params:
            units.append(own)
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return units


def gradient_buckets(model: nn.Module, bucket_numel: int) -> list[ParamGroupSpec]:
    """Buckets of about `bucket_numel` elements, last-registered parameters first.

    Backward produces gradients roughly in reverse registration order, so filling buckets in
    that order lets the first bucket's reduction start while backward is still running.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buckets: list[ParamGroupSpec] = []
    current = ParamGroupSpec("bucket0")
    for name, p in reversed(params):
        if current.params and current.numel + p.numel() > bucket_numel:
            buckets.append(current)
            current = ParamGroupSpec(f"bucket{len(buckets)}")
        current.params.append((name, p))
    if current.params:
        buckets.append(current)
    return buckets
