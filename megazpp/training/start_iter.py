"""`outer.start_iter` S: synchronous data parallelism for the first S iterations of a two-level
job, islands from S on (DiLoCo's warm start, arXiv 2311.08105, inside one job).

Why here: the switch builds engines (`zero_factory`, as a run's start does) and reuses the
checkpoints' resharding (`checkpoint.zero_shards`), so it sits in the training layer with the
loop that calls it; the engines themselves know nothing of it.

Before S the run's engine is the ZeRO engine over all DP ranks with the run's zero strategy
(the `paro_strategy: auto` planner prices it as the synchronous job it is); its checkpoints are
synchronous ones. At S (after step S, before its evaluation and save, on every rank at once)
`IslandSwitch` moves the state onto the islands in memory, no files:
1. `release`: every DP rank's state of this rank's (tp, pp) part (a host copy of its shards, as
   a checkpoint's rank files hold them) is gathered over the part's DP group (one
   `all_gather_object`, counted under `SWITCH_TAG`) and assembled into full tensors by
   parameter name (`zero_shards.full_part_state`, the resharding a warm-start `--load` runs on
   rank files; `MemoryPart` stands in for the files); the synchronous engine is closed;
2. the caller drops its last reference, so the synchronous engine's buffers and optimizer
   state are freed before anything of the islands' is made;
3. `build`: the model's parameters are set to the full values (the islands' engine is built
   from the model, as at a start), the islands' engine is built (`build_islands`) and loads the
   full state through `DiLoCoEngine.load_state_dict`, the path a warm start from a synchronous
   checkpoint takes: the outer snapshot is the masters at S, the outer momentum zero, and the
   inner steps count on from the engine's step count (S unless fp16 skipped steps), so the
   syncs stay where a warm start from a checkpoint at S puts them: at the iterations that are
   multiples of H (fragment f at offset f H / F), the first at the first one after S (S + H
   when H divides S), landing `outer.overlap_steps` later.
So the run is, bit for bit, a synchronous run saved at S and a two-level run warm-started from
that checkpoint (tests/test_outer_start_iter.py). A rank holds its part's full state on the
host twice while it switches (the gathered shards and the assembled tensors: 16 bytes per
parameter each in fp32), as a resharding load holds it once.
"""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path

import torch

from megazpp.checkpoint.format import LATEST_FILE, LoadedCheckpoint, latest_checkpoint, read_metadata
from megazpp.checkpoint.manager import LoadKind, LoadPlan
from megazpp.checkpoint.reshard import full_weight
from megazpp.checkpoint.zero_shards import FullPartState, full_part_state
from megazpp.config.options import RunOptions
from megazpp.errors import CheckpointError, required
from megazpp.model.gpt import GPTModel
from megazpp.optim.engine_protocol import Engine
from megazpp.outer.diloco import DiLoCoEngine
from megazpp.outer.fragments import first_sync_after
from megazpp.parallel import comm
from megazpp.parallel.counter import counter
from megazpp.parallel.pipeline import counts_in_norm
from megazpp.parallel.topology import Topology
from megazpp.state import StateDict
from megazpp.training.banner import engine_lines
from megazpp.training.zero_factory import build_zero_engine

log = logging.getLogger(__name__)

SWITCH_TAG = "start_iter/state"  # the counted gather of the synchronous engine's shards


def build_islands(model: GPTModel, options: RunOptions, topology: Topology) -> DiLoCoEngine:
    """The two-level engine: the ZeRO engine over this rank's island inside `DiLoCoEngine`."""
    outer = required(options.outer, "outer")
    island = topology.island_view(outer.island_nodes)
    inner = build_zero_engine(model, options, island, counts_in_norm=counts_in_norm(model, island))
    return DiLoCoEngine(inner, outer, island)


def planned_iteration(plan: LoadPlan) -> int:
    """The iteration the run's checkpoint resumes at (its newest's metadata; 0 when the run
    starts from scratch or an import, or the newest cannot be read: the loader then names it or
    falls back, and `check_start` compares what it loaded)."""
    if plan.kind is not LoadKind.RESUME or plan.directory is None:
        return 0
    try:
        path = latest_checkpoint(plan.directory)
        return int(read_metadata(path)["iteration"]) if path is not None else 0
    except (CheckpointError, KeyError, ValueError):
        return 0


def check_start(options: RunOptions, engine: Engine, loaded: LoadedCheckpoint | None) -> None:
    """The engine built from the plan's checkpoint against the one loaded (they differ only
    when `--load-fallback` left a damaged newest checkpoint for an older one on the other side
    of S): CheckpointError naming both."""
    outer = options.outer
    if outer is None or not outer.start_iter:
        return
    at = 0 if loaded is None or loaded.weights_only else int(loaded.state["iteration"])
    if isinstance(engine, DiLoCoEngine) != (at >= outer.start_iter):
        built = "the islands" if isinstance(engine, DiLoCoEngine) else "the synchronous phase"
        raise CheckpointError(
            f"{loaded.path if loaded is not None else 'the start'}: iteration {at}, while the run was built for "
            f"{built} from its newest checkpoint's iteration (outer.start_iter {outer.start_iter}): the "
            f"newest was damaged and {LATEST_FILE} was not moved; point {LATEST_FILE} at the checkpoint to resume"
        )


def island_switch(model: GPTModel, options: RunOptions, topology: Topology, engine: Engine) -> IslandSwitch | None:
    """The trainer's switch when `engine` is the synchronous phase of a two-level run, else None."""
    if options.outer is None or isinstance(engine, DiLoCoEngine):
        return None
    return IslandSwitch(model, options, topology)


class MemoryPart:
    """The DP ranks' engine states of one (tp, pp) part as the checkpoint reader's rank files
    (`zero_shards.PartReader`), so the switch reshards them as a warm-start load does."""

    def __init__(self, states: list[StateDict], iteration: int) -> None:
        self.states, self.dp, self.iteration = states, len(states), iteration
        self.path = Path(f"<the synchronous engine at iteration {iteration}>")

    def rank_file(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> Path:
        return self.path / f"dp rank {dp_rank}"

    def rank_state(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> StateDict:
        return {"iteration": self.iteration, "engine": self.states[dp_rank]}


def _on_host(state: object) -> object:
    """`state` with every tensor a host copy (a checkpoint's rank files are read so), so that it
    pickles the same on CUDA ranks and its peers unpickle it on the host."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _on_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_host(v) for v in state)
    return state


class IslandSwitch:
    """The move from the synchronous engine to the islands at `outer.start_iter` (the module
    docstring): `due` after the step S, `release` the synchronous engine, `build` the islands'."""

    def __init__(self, model: GPTModel, options: RunOptions, topology: Topology) -> None:
        self.model, self.options, self.topology = model, options, topology
        self.outer = required(options.outer, "outer")
        self.at = self.outer.start_iter
        self._released: weakref.ref[Engine] | None = None

    def due(self, iteration: int) -> bool:
        return iteration == self.at

    def release(self, engine: Engine) -> FullPartState:
        """Collective: the synchronous engine's state as full tensors of this rank's part, the
        engine closed (its hooks removed); the caller then drops it."""
        topo = self.topology
        mine = _on_host(engine.state_dict())
        if not isinstance(mine, dict):
            raise TypeError("an engine's state dict is a dict")
        states = comm.all_gather_object(mine, group=topo.dp_group, tag=SWITCH_TAG)
        del mine
        part = full_part_state(MemoryPart(states, self.at), topo.tp_rank, topo.pp_rank)
        del states
        engine.close()
        self._released = weakref.ref(engine)
        return part

    def build(self, part: FullPartState) -> tuple[DiLoCoEngine, list[str]]:
        """Collective: the islands' engine holding `part` (a warm start's state: snapshot the
        masters, zero outer momentum), and the lines that say what happened."""
        gc.collect()  # the synchronous engine's cycles (hooks, paths) go before the islands' is made
        freed = self._released is not None and self._released() is None
        weights = part.tensors["params"]
        for name, param in self.model.named_parameters():
            full = full_weight(weights, name)
            if full is None:
                raise CheckpointError(f"start_iter: the synchronous engine's state holds no parameter {name!r}")
            param.data = full.to(param.device, param.dtype)
        gathered = counter.step_totals()["tags"].get(SWITCH_TAG, {"intra": 0, "inter": 0})
        engine = build_islands(self.model, self.options, self.topology)
        engine.load_state_dict(part.engine_state())
        o = self.outer
        moved = gathered["intra"] + gathered["inter"]
        lines = [
            f"iter {self.at}: outer.start_iter: synchronous data parallelism ends; the masters and optimizer "
            f"state moved onto {engine.islands} islands of {engine.island.dp} DP rank(s) in memory ({moved / 1e6:.3g} "
            f"MB gathered per rank{'' if freed else '; the synchronous engine is still referenced, not freed'}); "
            f"outer snapshot = the masters, zero outer momentum; first outer sync lands at iteration "
            f"{first_sync_after(self.at, o.sync_every, o.overlap_steps)} (syncs at multiples of H = {o.sync_every})"
        ]
        lines += engine_lines(self.options.config, engine)
        if not freed:
            log.warning("start_iter: the synchronous engine is still referenced after the switch: its memory stays")
        return engine, lines
