"""What one rank of a pipeline stage trains: its fetch groups, gradient buckets, layers.

Why the engine's own grouping: padding (every bucket is rounded up to the DP size, times
ZeRO++'s quantization block) and the number of collective calls (latency) depend on how
parameters are grouped, so the planner calls the engine's own grouping (`zero.units.engine_groups`)
for the exact fetch groups and buckets the engine would build, instead of treating the model as
one flat block. With a live model (`paro_strategy: auto`) this is exact; from a config the model is built on the meta
device (no memory), and tensor parallelism is applied by dividing the sizes of the layers that
shard (column / row parallel weights, vocabulary embedding), so bucket boundaries under TP > 1
are approximate (padding differs by at most D elements per bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megazpp.errors import ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazpp.parallel.topology import check_model_split, stage_layer_range
from megazpp.zero.layout import is_vector, layout_order
from megazpp.zero.strategy import Level, Strategy
from megazpp.zero.units import ParamGroupSpec, engine_groups


@dataclass(frozen=True)
class StageShape:
    """One rank of pipeline stage `stage`: element counts before padding.

    `fetch_groups` are the parameter fetch groups (used when p is sharded), `buckets` the
    gradient buckets (p = N), both of trainable elements only; `frozen` elements are not the
    engine's (it leaves frozen parameters whole on every rank). `frozen_groups` are the frozen
    elements of each fetch group under a modelled trainable fraction, for the PaRO paper's PEFT
    accounting, where frozen weights are sharded at level p like the trainable ones
    (`Workload.shard_frozen`). The last `persistent` fetch groups are the persistent buckets
    (`units.split_persistent`): parameters kept whole, never fetched.
    `group_tensors` / `bucket_tensors`: per group, its tensors as (numel, is 1-D) in bucket
    layout order, which ZeRO++'s per-tensor block alignment and qgZ's exact 1-D values depend
    on (`layout.tensor_layout`); empty when a trainable fraction < 1 is modelled (then each
    group counts as one tensor).
    """

    stage: int
    fetch_groups: tuple[int, ...]
    buckets: tuple[int, ...]
    frozen: int
    layers: int
    first: bool
    last: bool
    frozen_groups: tuple[int, ...] = ()
    fetch_group_tensors: tuple[tuple[tuple[int, bool], ...], ...] = ()
    bucket_tensors: tuple[tuple[tuple[int, bool], ...], ...] = ()
    persistent: int = 0

    def groups(self, strategy: Strategy) -> tuple[int, ...]:
        return self.buckets if strategy.params == Level.N else self.fetch_groups

    def group_tensors(self, strategy: Strategy) -> tuple[tuple[tuple[int, bool], ...], ...]:
        """Per group of `groups(strategy)`: its tensors (numel, is 1-D); one whole-group
        tensor each when unknown."""
        tensors = self.bucket_tensors if strategy.params == Level.N else self.fetch_group_tensors
        return tensors or tuple(((n, False),) for n in self.groups(strategy))

    @property
    def trainable(self) -> int:
        return sum(self.fetch_groups)


def _shards_over_tp(module: nn.Module, name: str) -> bool:
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return True
    return isinstance(module, RowParallelLinear) and name == "weight"


def _rank_numel(model: nn.Module, tp: int) -> dict[int, int]:
    """Elements one TP rank holds of each parameter (by id) of a model built with TP = 1."""
    sizes = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            sizes[id(p)] = p.numel() // tp if tp > 1 and _shards_over_tp(module, name) else p.numel()
    return sizes


def _trainable(n: int, fraction: float) -> int:
    return n if fraction >= 1 else max(1, math.ceil(n * fraction))


def _numels(specs: list[ParamGroupSpec], sizes: dict[int, int], fraction: float) -> tuple[list[int], list[int]]:
    """(trainable, frozen) elements of each group under `fraction`."""
    trainable, frozen = [], []
    for spec in specs:
        n = sum(sizes[id(p)] for _, p in spec.params)
        trainable.append(_trainable(n, fraction))
        frozen.append(n - trainable[-1])
    return trainable, frozen


def _tensors(specs: list[ParamGroupSpec], sizes: dict[int, int]) -> tuple[tuple[tuple[int, bool], ...], ...]:
    """Per group: (numel on this rank, is 1-D) of each tensor, in bucket layout order."""
    return tuple(tuple((sizes[id(p)], is_vector(p.shape)) for _, p in layout_order(spec.params)) for spec in specs)


def shape_of_model(
    model: nn.Module,
    *,
    bucket_numel: int,
    threshold: int,
    fetch_mode: str = "layer",
    stage: int = 0,
    layers: int,
    first: bool = True,
    last: bool = True,
    tp_divisor: int = 1,
    trainable_fraction: float = 1.0,
    persistence: int = 0,
) -> StageShape:
    """The exact grouping the engine builds for `model` (this rank's model): `bucket_numel`
    bounds every bucket and fetch group (the smaller of `zero.reduce_bucket_size` and
    `zero.allgather_bucket_size`), `fetch_mode` is `zero.fetch_groups`, `persistence` is
    `zero.stage3_param_persistence_threshold` (compared with full, not TP-divided, sizes).

    `tp_divisor` > 1 only for a model built with TP = 1 standing in for a TP shard;
    `trainable_fraction` < 1 models PEFT as that fraction of every unit being trainable
    (the rest frozen), for models whose parameters are all trainable here.
    """
    if not 0 < trainable_fraction <= 1:
        raise ConfigError(f"trainable_fraction = {trainable_fraction!r}: expected a fraction in (0, 1]")
    sizes = _rank_numel(model, tp_divisor)
    frozen_params = sum(sizes[id(p)] for p in model.parameters() if not p.requires_grad)
    bound = bucket_numel * tp_divisor
    sharded, kept_whole = engine_groups(
        model, sharded=True, threshold=threshold, fetch_mode=fetch_mode, persistence=persistence, bucket_numel=bound
    )
    specs = sharded + kept_whole
    bucket_specs, _ = engine_groups(
        model, sharded=False, threshold=threshold, fetch_mode=fetch_mode, persistence=0, bucket_numel=bound
    )
    groups, frozen_g = _numels(specs, sizes, trainable_fraction)
    buckets, _ = _numels(bucket_specs, sizes, trainable_fraction)
    frozen_groups = tuple(frozen_g) if any(frozen_g) else ()
    whole = trainable_fraction >= 1
    return StageShape(
        stage,
        tuple(groups),
        tuple(buckets),
        frozen_params + sum(frozen_g),
        layers,
        first,
        last,
        frozen_groups,
        _tensors(specs, sizes) if whole else (),
        _tensors(bucket_specs, sizes) if whole else (),
        len(kept_whole),
    )


def shapes_of_config(
    cfg: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    bucket_numel: int = 500_000_000,
    threshold: int = 0,
    fetch_mode: str = "layer",
    trainable_fraction: float = 1.0,
    persistence: int = 0,
) -> list[StageShape]:
    """One StageShape per pipeline stage, from models built on the meta device (no memory);
    a model that does not split over `tp` x `pp` is refused as the job's start-up check refuses
    it (`parallel.topology.check_model_split`)."""
    check_model_split(cfg, tp, pp)
    shapes = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        with torch.device("meta"):
            model = GPTModel(
                cfg, pre_process=first, post_process=last, layer_range=stage_layer_range(cfg.num_layers, pp, stage)
            )
        shapes.append(
            shape_of_model(
                model,
                bucket_numel=bucket_numel,
                threshold=threshold,
                fetch_mode=fetch_mode,
                stage=stage,
                layers=cfg.num_layers // pp,
                first=first,
                last=last,
                tp_divisor=tp,
                trainable_fraction=trainable_fraction,
                persistence=persistence,
            )
        )
    return shapes
