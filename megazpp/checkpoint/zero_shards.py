"""Full per-parameter tensors out of the DP shards of a ZeRO checkpoint part.

Every rank file of a ZeRO run records, per bucket, its layout (global parameter names,
shapes, flat offsets, padding) and the `[start, end)` ranges of the bucket's unpermuted flat
buffer that each saved tensor covers (`ZeroEngine.state_dict`). So a reader fills one flat
buffer per bucket and kind (parameters, fp32 masters, the optimizer's state tensors: AdamW's
moments or SGD's momentum buffer) from all DP ranks' files
without knowing the PaRO strategy or the nested I/G order, checks that every element of the
unpadded part was covered, and slices tensors by name. Consolidated exports and resharding
resume (`reshard.py`) both start from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megazpp.errors import CheckpointError
from megazpp.model.gpt import EMBEDDING_WEIGHT
from megazpp.optim.optimizer import OPTIMIZER_NAME_KEY
from megazpp.optim.options import STATE_NAMES
from megazpp.outer.diloco import OUTER_STATE_KEY
from megazpp.state import StateDict
from megazpp.zero.engine_state import FULL_STATE_FORMAT
from megazpp.zero.layout import LayoutRecord


class PartReader(Protocol):
    """What is read from a checkpoint (`reader.CheckpointReader`)."""

    path: Path
    dp: int
    iteration: int

    def rank_file(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> Path: ...

    def rank_state(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> StateDict: ...


KINDS = ("params", "masters", *STATE_NAMES)


@dataclass
class FullPartState:
    """One (tp, pp) part's ZeRO state as full tensors keyed by global parameter name."""

    tensors: dict[str, dict[str, torch.Tensor]]  # kind -> name -> tensor (the optimizer's kinds may be empty)
    optimizer_name: str | None  # None: saved before SGD existed (AdamW)
    optimizer_step: torch.Tensor | None  # AdamW's step count (the same for every parameter); SGD has none
    step_count: int
    loss_scaler: StateDict | None
    source: str  # "strategy S, dp D, paro group K" of the checkpoint

    def engine_state(self) -> StateDict:
        """The input of `ZeroEngine.load_state_dict` for a layout other than the saved one."""
        return {
            "format": FULL_STATE_FORMAT,
            "source": self.source,
            "step_count": self.step_count,
            "loss_scaler": self.loss_scaler,
            OPTIMIZER_NAME_KEY: self.optimizer_name,
            "optimizer_step": self.optimizer_step,
            "params": self.tensors["params"],
            "masters": self.tensors["masters"],
            "optimizer_state": {k: self.tensors[k] for k in STATE_NAMES},
        }


def _islands(reader: PartReader, tp_rank: int, pp_rank: int) -> int:
    engine = reader.rank_state(tp_rank, pp_rank, 0).get("engine")
    outer = engine.get(OUTER_STATE_KEY) if isinstance(engine, dict) else None
    return int(outer["islands"]) if outer else 1


def _at_last_sync(engine: StateDict) -> StateDict:
    """A two-level rank's engine state with the islands' parameters at the last outer sync (the
    outer snapshot, the same on every island) in place of its own masters; its parameters at p
    are then made from those (`full_part_state`), so the island's own drift since is left out."""
    snapshot = engine[OUTER_STATE_KEY]["snapshot"]
    buckets, start = [], 0
    for b in engine["buckets"]:
        masters = []
        for m in b["masters"]:
            masters.append(snapshot[start : start + m.numel()].view_as(m).clone())
            start += m.numel()
        if masters:  # a frozen bucket (no masters) keeps its parameters: they never change
            b = {**b, "masters": masters, "param_store": None, "param_dtype": b["param_store"].dtype}
        buckets.append(b)
    return {**engine, "buckets": buckets}


def _zero_engine_states(reader: PartReader, tp_rank: int, pp_rank: int) -> list[StateDict]:
    """Every DP rank's engine state of the part; for a two-level checkpoint, the first island's
    ranks at the last outer sync (`_at_last_sync`): the islands' shards hold the same places."""
    states = []
    islands = _islands(reader, tp_rank, pp_rank)
    dp = reader.dp // islands
    for dp_rank in range(dp):
        file = reader.rank_file(tp_rank, pp_rank, dp_rank)
        state = reader.rank_state(tp_rank, pp_rank, dp_rank)
        if state.get("iteration") != reader.iteration:
            raise CheckpointError(
                f"{file}: holds iteration {state.get('iteration')}, the checkpoint's metadata says {reader.iteration}"
            )
        engine = state.get("engine")
        if not isinstance(engine, dict) or "strategy" not in engine:
            raise CheckpointError(f"{file}: holds no ZeRO engine state to reassemble")
        if "optimizer_slots" not in engine or any("ranges" not in b for b in engine["buckets"]):
            raise CheckpointError(
                f"{file}: ZeRO state (strategy {engine['strategy']}) without shard "
                "placement (saved by an older megazpp): its shards cannot be "
                "reassembled; it resumes only at its own layout"
            )
        if engine["dp_rank"] != dp_rank or engine["dp"] != dp:
            raise CheckpointError(
                f"{file}: engine state of dp rank {engine['dp_rank']} of {engine['dp']}, expected {dp_rank} of {dp}"
            )
        states.append(_at_last_sync(engine) if islands > 1 else engine)

    def shared(engine: StateDict) -> list[StateDict]:
        return [{k: v for k, v in b["layout"].items() if k != "dp_index"} for b in engine["buckets"]]

    for dp_rank, engine in enumerate(states[1:], start=1):
        if shared(engine) != shared(states[0]):
            raise CheckpointError(
                f"{reader.rank_file(tp_rank, pp_rank, dp_rank)}: bucket layouts "
                f"differ from dp rank 0's (files of different runs?)"
            )
    return states


def _assemble(states: list[StateDict], index: int, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """Bucket `index`'s flat buffers filled from every rank's ranges, sliced by name."""
    layout: LayoutRecord = states[0]["buckets"][index]["layout"]
    padded, numel = layout["padded"], layout["numel"]
    flats: dict[str, torch.Tensor] = {}
    covered = {kind: torch.zeros(padded, dtype=torch.bool) for kind in KINDS}

    def put(kind: str, lo: int, hi: int, tensor: torch.Tensor) -> None:
        if kind not in flats:
            flats[kind] = torch.zeros(padded, dtype=tensor.dtype)
        if hi - lo != tensor.numel():
            raise CheckpointError(f"{where}: {kind} piece of {tensor.numel()} elements for range [{lo}, {hi})")
        flats[kind][lo:hi] = tensor.reshape(-1)
        covered[kind][lo:hi] = True

    for engine in states:
        saved = engine["buckets"][index]
        ranges = saved["ranges"]
        if saved["param_store"] is not None:
            lo, hi = ranges["param_store"]
            put("params", lo, hi, saved["param_store"])
        for (lo, hi), master in zip(ranges["masters"], saved["masters"]):
            put("masters", lo, hi, master)
        optimizer = engine["optimizer"]["state"]
        for slot, (b, j) in enumerate(engine["optimizer_slots"]):
            if b == index and slot in optimizer:
                lo, hi = ranges["masters"][j]
                for kind in STATE_NAMES:
                    if kind in optimizer[slot]:
                        put(kind, lo, hi, optimizer[slot][kind])
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind in KINDS:
        if kind not in flats:
            continue
        missing = (~covered[kind][:numel]).nonzero()
        if len(missing):
            raise CheckpointError(
                f"{where}: bucket {layout['names'][:1]}... {kind}: no rank file covers flat element {int(missing[0])}"
            )
        out[kind] = {
            name: flats[kind][off : off + torch.Size(shape).numel()].view(shape)
            for name, off, shape in zip(layout["names"], layout["offsets"], layout["shapes"])
        }
    return out


def _optimizer_step(states: list[StateDict]) -> torch.Tensor | None:
    for engine in states:
        for entry in engine["optimizer"]["state"].values():
            if "step" in entry:
                return torch.as_tensor(entry["step"]).clone()
    return None


def full_part_state(reader: PartReader, tp_rank: int, pp_rank: int) -> FullPartState:
    """The (tp_rank, pp_rank) part's ZeRO state from all its DP ranks' files."""
    states = _zero_engine_states(reader, tp_rank, pp_rank)
    tensors: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    where = f"{reader.path} (tp {tp_rank}, pp {pp_rank})"
    for index in range(len(states[0]["buckets"])):
        for kind, by_name in _assemble(states, index, where).items():
            tensors[kind].update(by_name)
    first = states[0]
    synced = [b["param_dtype"] for b in first["buckets"] if "param_dtype" in b]
    if synced:  # a two-level checkpoint: its trainable parameters are the synced masters
        for name, master in tensors["masters"].items():
            tensors["params"].setdefault(name, master.to(synced[0]))
    partial = [k for k in STATE_NAMES if tensors[k] and len(tensors[k]) != len(tensors["masters"])]
    if partial:
        raise CheckpointError(f"{where}: optimizer state {partial[0]} saved for only some parameters")
    return FullPartState(
        tensors,
        first.get(OPTIMIZER_NAME_KEY),
        _optimizer_step(states),
        int(first["step_count"]),
        first.get("loss_scaler"),
        f"strategy {first['strategy']}, dp {first['dp']}, paro group {first['k']}",
    )


def consolidated_part(
    reader: PartReader, tp_rank: int, pp_rank: int, model: dict[str, torch.Tensor], masters: bool
) -> dict[str, torch.Tensor]:
    """DP rank 0's `model` state of a ZeRO part with every parameter whole (from the shards;
    the fp32 masters instead with `masters`). A tied output layer is the embedding's tensor."""
    full = full_part_state(reader, tp_rank, pp_rank).tensors["masters" if masters else "params"]
    out = dict(model)
    for key in model:
        if key in full:
            out[key] = full[key]
        elif key == "output_layer.weight" and EMBEDDING_WEIGHT in full:
            out[key] = full[EMBEDDING_WEIGHT]
    return out
