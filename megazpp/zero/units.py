"""Which parameters travel together: parameter units and fetch groups (p sharded), gradient
buckets (p = N).

Why units follow modules: a unit is where the fetch hooks go (its module's forward and backward
need its parameters whole), so it must be a module subtree. `module_granularity_threshold`
(DeepSpeed's `stage3_module_granularity_threshold`) merges fine-grained subtrees: a module whose
parameter count divided by (1 + its number of descendant modules) is below the threshold becomes
one unit with its whole subtree, so a layer of 64 three-linear experts costs one hook instead of
197. Threshold 0 gives one unit per module that owns parameters.

A module whose forward is compiled (`training.compile` compiles each transformer layer's
`forward`) is always one unit with its whole subtree, whatever the threshold: its fetch hooks
must run in its `__call__`, outside the compiled code. Hooks on modules inside it would run
inside the compiled forward, where TorchDynamo traces them (it traced the parameter swap and
then failed Inductor's size check on a released parameter) instead of running them. Gathered
before the call and released after it, the parameters have the shapes the graph was traced
with whenever the graph runs: torchtitan compiles each block over FSDP2's sharded parameters
the same way, the gather outside the block's compiled code.

Why fetch groups on top: each collective call costs a fixed host time (1-4 ms on CPU ranks,
whatever its size), so gathering a Llama layer's seven units one by one costs seven calls per
stage where one would do. A fetch group is a run of consecutive units sharing one flat buffer:
one all-gather per stage fetches it, one reduce-scatter per stage reduces its gradients.
`layer` (default) groups the units of each repeated block (an element of a ModuleList /
ModuleDict, i.e. a transformer layer) and merges the consecutive units outside any block (the
final norm with the output layer); `size` fills groups in registration order regardless of
blocks. Either way a group holds at most `max_numel` elements (DeepSpeed's bounds on one
all-gather and one reduction call: the smaller of `allgather_bucket_size` and
`reduce_bucket_size`), a unit larger than that forming a group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

FETCH_GROUP_MODES = ("layer", "size")


@dataclass
class ParamGroupSpec:
    """Parameters that share one flat buffer; `modules` are the unit roots where its fetch
    hooks go (empty for a gradient bucket of replicated parameters)."""

    name: str
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def _subtree_stats(module: nn.Module, trainable: bool = True) -> tuple[int, int]:
    """(trainable (or frozen) parameter elements in the subtree, number of descendant modules)."""
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad == trainable)
    descendants = sum(1 for _ in module.modules()) - 1
    return numel, descendants


def is_fine_grained(module: nn.Module, threshold: int, trainable: bool = True) -> bool:
    numel, descendants = _subtree_stats(module, trainable)
    return numel > 0 and numel / (1 + descendants) < threshold


def is_compiled(module: nn.Module) -> bool:
    """The module's own forward was replaced by a torch.compile'd one (see the docstring)."""
    return hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")


def parameter_units(model: nn.Module, threshold: int, trainable: bool = True) -> list[ParamGroupSpec]:
    """Units in module-registration order (the recorded execution order refines prefetch), of
    the trainable parameters, or of the frozen ones (`trainable=False`)."""
    units: list[ParamGroupSpec] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if is_fine_grained(module, threshold, trainable) or is_compiled(module):
            unit = ParamGroupSpec(name or "<root>", modules=[module])
            for pname, p in module.named_parameters(prefix=name):
                if p.requires_grad == trainable and id(p) not in seen:
                    seen.add(id(p))
                    unit.params.append((pname, p))
            if unit.params:
                units.append(unit)
            return
        own = ParamGroupSpec(name or "<root>", modules=[module])
        for pname, p in module.named_parameters(prefix=name, recurse=False):
            if p.requires_grad == trainable and id(p) not in seen:
                seen.add(id(p))
                own.params.append((pname, p))
        if own.params:
            units.append(own)
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return units


def _blocks(model: nn.Module) -> dict[int, nn.Module]:
    """Module id -> the outermost repeated block (element of a ModuleList / ModuleDict) it lies in."""
    block_of: dict[int, nn.Module] = {}
    for module in model.modules():  # pre-order: outer containers claim their subtrees first
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            for child in module.children():
                for m in child.modules():
                    block_of.setdefault(id(m), child)
    return block_of


def fetch_groups(model: nn.Module, units: list[ParamGroupSpec], mode: str, max_numel: int) -> list[ParamGroupSpec]:
    """Consecutive `units` merged into fetch groups (`mode` in FETCH_GROUP_MODES)."""
    block_of = _blocks(model)
    groups: list[ParamGroupSpec] = []
    last_key: object = object()
    for unit in units:
        starts = not groups or groups[-1].numel + unit.numel > max_numel
        if mode == "layer":
            block = block_of.get(id(unit.modules[0]))
            key: object = None if block is None else id(block)
            starts = starts or key != last_key
            last_key = key
        if starts:
            groups.append(ParamGroupSpec(unit.name))
        groups[-1].params.extend(unit.params)
        groups[-1].modules.extend(unit.modules)
    return groups


def gradient_buckets(model: nn.Module, bucket_numel: int) -> list[ParamGroupSpec]:
    """Buckets of about `bucket_numel` elements, last-registered parameters first.

    Backward produces gradients roughly in reverse registration order, so filling buckets in
    that order lets the first bucket's reduction start while backward is still running.
    """
    return _buckets([(n, p) for n, p in model.named_parameters() if p.requires_grad], bucket_numel, "bucket")


def _buckets(params: list[tuple[str, nn.Parameter]], bucket_numel: int, prefix: str) -> list[ParamGroupSpec]:
    buckets: list[ParamGroupSpec] = []
    current = ParamGroupSpec(f"{prefix}0")
    for name, p in reversed(params):
        if current.params and current.numel + p.numel() > bucket_numel:
            buckets.append(current)
            current = ParamGroupSpec(f"{prefix}{len(buckets)}")
        current.params.append((name, p))
    if current.params:
        buckets.append(current)
    return buckets


def bucket_bound(reduce_bucket_size: int, allgather_bucket_size: int) -> int:
    """The most elements one bucket or fetch group holds: it is reduced by one collective per
    stage and gathered (fetched or refreshed) by one, so both of DeepSpeed's bounds hold for it."""
    return min(reduce_bucket_size, allgather_bucket_size)


def engine_groups(
    model: nn.Module, *, sharded: bool, threshold: int, fetch_mode: str, persistence: int, bucket_numel: int
) -> tuple[list[ParamGroupSpec], list[ParamGroupSpec]]:
    """The groups a ZeroEngine builds for `model`'s trainable parameters, as (groups, kept
    whole): with parameters `sharded` (p = I, G) the fetch groups of its units
    (`threshold`: `module_granularity_threshold`, `fetch_mode`: `fetch_groups`) and the
    persistent buckets (`persistence`: `stage3_param_persistence_threshold`); with p = N the
    gradient buckets and nothing kept whole (`ZeroOptions` refuses a threshold there).
    The planner prices the same call, so its padding and call counts are the engine's."""
    if not sharded:
        return gradient_buckets(model, bucket_numel), []
    units, whole = split_persistent(parameter_units(model, threshold), persistence, bucket_numel)
    return fetch_groups(model, units, fetch_mode, bucket_numel), whole


def split_persistent(
    units: list[ParamGroupSpec], threshold: int, bucket_numel: int
) -> tuple[list[ParamGroupSpec], list[ParamGroupSpec]]:
    """DeepSpeed's `stage3_param_persistence_threshold`: parameters of fewer than `threshold`
    elements leave their units before units form fetch groups, and are kept whole on every
    rank, in buckets of their own, last-registered first like gradient buckets (the order
    backward produces them) and bounded by `bucket_numel`: one refresh collective per stage
    after each step moves them all, and no fetch ever does. A unit left without parameters (a
    norm) goes with its hooks: its module would otherwise gather its layer's group again for
    its own backward, after the group's gradients were in."""
    if threshold <= 0:
        return units, []
    persistent = [(n, p) for u in units for n, p in u.params if p.numel() < threshold]
    small = {id(p) for _, p in persistent}
    kept = []
    for u in units:
        params = [(n, p) for n, p in u.params if id(p) not in small]
        if params:
            kept.append(ParamGroupSpec(u.name, params, u.modules))
    return kept, _buckets(persistent, bucket_numel, "persistent")
