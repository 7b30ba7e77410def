"""How a megazpp model's full weights are cut into tensor- and pipeline-parallel pieces.

Nothing here is a hand-written table of parameter names: each pipeline stage's GPTModel is
built on the meta device (no memory, no values), and its modules say how each parameter is
split. A column-parallel linear splits its weight and bias by output rows (dim 0), a
row-parallel linear its weight by input columns (dim 1) with a replicated bias, the
vocab-parallel embedding its rows (dim 0); everything else is replicated on every TP rank.
So the layout follows the model code wherever it goes.

"Full weights" are keyed by the names of the single-process model's parameters; a tied
output layer is not a separate entry (it IS the embedding), even though a last pipeline
stage without the embedding holds its own copy under `output_layer.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from megazpp.errors import CheckpointError
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import EMBEDDING_WEIGHT, GPTModel
from megazpp.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megazpp.parallel.topology import Topology, check_model_split

TIED_OUTPUT_WEIGHT = "output_layer.weight"


def _split_dims(module: nn.Module) -> dict[str, int | None]:
    """Which dimension of each of `module`'s own parameters is split over TP ranks."""
    if isinstance(module, ColumnParallelLinear):
        return {"weight": 0, "bias": 0}
    if isinstance(module, RowParallelLinear):
        return {"weight": 1, "bias": None}
    if isinstance(module, VocabParallelEmbedding):
        return {"weight": 0}
    return {}


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: its state-dict keys (in order), their full shapes and TP split
    dimension (None: replicated), and the names of its distinct parameters in
    `named_parameters` order (the order engines keep per-parameter state in)."""

    pp_rank: int
    full_shapes: dict[str, torch.Size]
    split_dims: dict[str, int | None]
    parameter_names: list[str]

    @property
    def keys(self) -> list[str]:
        return list(self.full_shapes)

    def shard_shape(self, key: str, tp: int) -> torch.Size:
        shape, dim = list(self.full_shapes[key]), self.split_dims[key]
        if dim is not None:
            shape[dim] //= tp
        return torch.Size(shape)


def layout_topology(tp: int, pp: int, tp_rank: int = 0, pp_rank: int = 0, *, dp: int = 1, dp_rank: int = 0) -> Topology:
    """The Topology rank (tp_rank, dp_rank, pp_rank) of a tp x dp x pp world would have, for
    naming its checkpoint file and finding its layers, without any process group (the
    converters run in one process)."""
    world = tp * pp * dp
    return Topology(
        rank=tp_rank + tp * (dp_rank + dp * pp_rank), world_size=world, tp=tp, pp=pp, dp=dp, ranks_per_node=world
    )


def stage_layouts(cfg: ModelConfig, tp: int, pp: int) -> list[StageLayout]:
    """Every pipeline stage's layout; checks first that the model divides into tp x pp."""
    check_model_split(cfg, tp, pp)
    stages = []
    for pp_rank in range(pp):
        topo = layout_topology(tp, pp, pp_rank=pp_rank)
        with torch.device("meta"):
            model = GPTModel(
                cfg,
                pre_process=topo.is_first_stage,
                post_process=topo.is_last_stage,
                layer_range=topo.layer_range(cfg.num_layers),
            )
        dims: dict[str, int | None] = {}
        for module_name, module in model.named_modules():
            for param_name, dim in _split_dims(module).items():
                dims[f"{module_name}.{param_name}" if module_name else param_name] = dim
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        stages.append(
            StageLayout(pp_rank, shapes, {k: dims.get(k) for k in shapes}, [n for n, _ in model.named_parameters()])
        )
    return stages


def full_weight_names(cfg: ModelConfig) -> list[str]:
    """Keys of the full weights: the single-process model's distinct parameters."""
    return stage_layouts(cfg, 1, 1)[0].parameter_names


def _full_source(key: str, cfg: ModelConfig) -> str:
    return EMBEDDING_WEIGHT if cfg.tie_embeddings and key == TIED_OUTPUT_WEIGHT else key


def shard_for_rank(
    full: Mapping[str, torch.Tensor],
    stage: StageLayout,
    cfg: ModelConfig,
    tp: int,
    tp_rank: int,
    keys: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict of the model part on (tp_rank, stage), cut from full weights (only its
    `keys` when given)."""
    out = {}
    for key in stage.keys if keys is None else keys:
        source = _full_source(key, cfg)
        if source not in full:
            raise CheckpointError(f"full weights lack {source!r}")
        tensor = full[source]
        if tensor.shape != stage.full_shapes[key]:
            raise CheckpointError(
                f"{source!r} has shape {tuple(tensor.shape)}, the model expects {tuple(stage.full_shapes[key])}"
            )
        dim = stage.split_dims[key]
        out[key] = tensor if dim is None else tensor.chunk(tp, dim=dim)[tp_rank].clone()
    return out


def merge_tp_shards(
    shards: list[Mapping[str, torch.Tensor]], stage: StageLayout, where: str
) -> dict[str, torch.Tensor]:
    """Inverse of `shard_for_rank` over all TP ranks of a stage. Every key must be present
    with its shard shape; replicated tensors must agree across ranks (if they do not, the
    checkpoint is inconsistent and any choice would silently pick one)."""
    tp = len(shards)
    out = {}
    for key in stage.keys:
        pieces = []
        for tp_rank, shard in enumerate(shards):
            if key not in shard:
                raise CheckpointError(f"{where}: tp rank {tp_rank} lacks {key!r}")
            piece = shard[key]
            if piece.shape != stage.shard_shape(key, tp):
                raise CheckpointError(
                    f"{where}: tp rank {tp_rank} holds {key!r} with shape {tuple(piece.shape)}, "
                    f"expected {tuple(stage.shard_shape(key, tp))} (full "
                    f"{tuple(stage.full_shapes[key])} at tp={tp}); different model config?"
                )
            pieces.append(piece)
        dim = stage.split_dims[key]
        if dim is not None:
            out[key] = torch.cat(pieces, dim=dim)
            continue
        for tp_rank, piece in enumerate(pieces[1:], start=1):
            if not torch.equal(piece, pieces[0]):
                raise CheckpointError(f"{where}: replicated tensor {key!r} differs between tp ranks 0 and {tp_rank}")
        out[key] = pieces[0]
    extra = sorted(set().union(*map(set, shards)) - set(stage.keys))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} (different model config?)")
    return out


def merge_stages(
    stage_weights: list[Mapping[str, torch.Tensor]], cfg: ModelConfig, where: str
) -> dict[str, torch.Tensor]:
    """Full weights from each stage's (TP-merged) tensors. A tied output layer held by the
    last stage must equal the first stage's embedding (the pipeline keeps them in sync)."""
    merged: dict[str, torch.Tensor] = {}
    for weights in stage_weights:
        for key, tensor in weights.items():
            if _full_source(key, cfg) != key:
                continue
            merged[key] = tensor
    if cfg.tie_embeddings and len(stage_weights) > 1:
        copy = stage_weights[-1].get(TIED_OUTPUT_WEIGHT)
        if copy is not None and not torch.equal(copy, merged[EMBEDDING_WEIGHT]):
            raise CheckpointError(
                f"{where}: the last stage's tied output weight differs from the first stage's embedding"
            )
    names = full_weight_names(cfg)
    return {name: merged[name] for name in names}
