"""ZeRO state across layouts: full per-parameter tensors out of every DP rank's shards, and a
resume at another data-parallel size or PaRO strategy.

Why "consolidate per name, then cut": a checkpoint's shards are slices of each bucket's flat
buffer, and the new engine may bucket, pad and nest the same parameters differently (another
D, another PaRO group size k, p = N size-capped buckets instead of one bucket per unit,
ZeRO++ block alignment). The only coordinates both layouts share are the parameters' global
names, so every saved flat tensor is placed by the `[start, end)` ranges its rank recorded
(`ZeroEngine.state_dict`), sliced into full tensors by name, and the new engine cuts those by
its own layout (`ZeroEngine.load_state_dict` with `engine_state.FULL_STATE_FORMAT`).

What is not carried: gradient accumulators (zero at a step boundary) and LoCo's error
buffers, which are the quantization error of each *sender's* contribution in the sender's
chunk coordinates: after a change of D the senders and the samples they reduce are others, so
no mapping of the old errors means anything; the new engine zeroes them and logs a warning
(the same state LoCo's periodic `reset_T` produces).

Memory: a resharding rank holds its (tp, pp) part's full state once (parameters + fp32
master + the optimizer's state: 16 bytes per parameter in fp32 with AdamW's two moments),
read from memory-mapped files.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megazpp.checkpoint.format import WEIGHTS_ONLY_KEY, LoadedCheckpoint, layout_of
from megazpp.checkpoint.reader import CheckpointReader
from megazpp.checkpoint.zero_shards import full_part_state
from megazpp.errors import CheckpointError
from megazpp.model.gpt import EMBEDDING_WEIGHT
from megazpp.optim.engine_protocol import Engine
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.zero.frozen import FROZEN_PREFIX
from megazpp.zero.inner_engine import ShardedEngine


def _reader(path: str | os.PathLike[str], topology: Topology) -> CheckpointReader:
    reader = CheckpointReader(path)
    if (reader.tp, reader.pp) != (topology.tp, topology.pp):
        raise CheckpointError(
            f"{reader.path}: saved with tp {reader.tp}, pp {reader.pp}; this run has "
            f"tp {topology.tp}, pp {topology.pp} (resharding changes only the "
            "data-parallel layout; change tp/pp by export and import)"
        )
    return reader


def _layout_differs(path: str | os.PathLike[str], engine: Engine, topology: Topology) -> bool:
    reader = _reader(path, topology)
    if reader.meta.get(WEIGHTS_ONLY_KEY):
        return False  # an import: starts any DP size through the weights-only path
    if {k: reader.meta.get(k) for k in layout_of(topology)} != layout_of(topology):
        return True
    saved = reader.rank_state(topology.tp_rank, topology.pp_rank, topology.dp_rank).get("engine")
    if not isinstance(engine, ShardedEngine):
        return isinstance(saved, dict) and "strategy" in saved
    if not isinstance(saved, dict) or "strategy" not in saved:
        return True
    layout = engine.shard_layout()
    mine = (layout.strategy.name, layout.dp, layout.group_size, layout.buckets)
    return (
        saved["strategy"],
        saved.get("dp"),
        saved.get("k"),
        # the trainable buckets: a state holds the frozen ones after them (engine_state.held_buckets)
        [b.get("layout") for b in saved.get("buckets", []) if not str(b.get("name")).startswith(FROZEN_PREFIX)],
    ) != mine


def needs_reshard(path: str | os.PathLike[str], engine: Engine, topology: Topology) -> bool:
    """Collectively: whether checkpoint `path` (an iter_N dir or a save dir) was written under
    another DP size, PaRO strategy, group size or bucket layout than `engine` has (tp and pp
    must match). Every rank gets the same answer, or the same CheckpointError."""
    try:
        answer, verdict = _layout_differs(path, engine, topology), ""
    except CheckpointError as exc:
        answer, verdict = False, str(exc)
    answers = comm.all_gather_object((answer, verdict), tag="checkpoint/verify")
    reasons = sorted({v for _, v in answers if v})
    if reasons:
        raise CheckpointError(" | ".join(reasons))
    return any(a for a, _ in answers)


def full_weight(weights: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The full tensor of model state key `key` among a part's full parameters by name (a tied
    output layer on another pipeline stage is the embedding's tensor); None for a buffer."""
    name = EMBEDDING_WEIGHT if key == "output_layer.weight" and key not in weights else key
    return weights.get(name)


def load_resharded(
    path: str | os.PathLike[str], topology: Topology, model: torch.nn.Module, engine: Engine
) -> LoadedCheckpoint:
    """Collectively read checkpoint `path` for this rank of a run with another DP layout: the
    returned state resumes through `Trainer.resume` like one of this run's own checkpoints.

    Run state (iteration, consumed samples, lr schedule, RNGs) comes from DP rank 0's file of
    this rank's (tp, pp) part: they are identical across DP replicas. `model` holds what this
    run's model holds now for parameters the engine keeps released (p = I / G), the whole
    weights otherwise; the engine state is full tensors the engine cuts by its layout.
    """
    try:
        reader = _reader(path, topology)
        if not isinstance(engine, ShardedEngine):
            raise CheckpointError(
                f"{reader.path}: resharding resumes into the ZeRO engine; this run "
                "uses LocalEngine (set a zero stage or paro_strategy)"
            )
        part = full_part_state(reader, topology.tp_rank, topology.pp_rank)
        base = reader.rank_state(topology.tp_rank, topology.pp_rank, 0)
        verdict = ""
    except CheckpointError as exc:
        verdict = str(exc)
    reasons = sorted({v for v in comm.all_gather_object(verdict, tag="checkpoint/verify") if v})
    if reasons:
        raise CheckpointError(f"{path}: cannot reshard: " + " | ".join(reasons))
    weights = part.tensors["params"]
    current = model.state_dict()
    model_state = {}
    for key, now in current.items():
        full = full_weight(weights, key)
        if full is not None and now.numel() == full.numel():
            model_state[key] = full.to(now.dtype)
        elif full is not None:
            model_state[key] = now  # released by the engine: its load fills the shard
        else:
            model_state[key] = base["model"][key]  # a buffer, identical on every DP rank
    state = {**base, "model": model_state, "engine": part.engine_state(), "layout": layout_of(topology)}
    return LoadedCheckpoint(Path(reader.path), dict(reader.meta), state)
