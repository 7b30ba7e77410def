"""The one place that decides what a run loads and that performs its loads and saves.

What a run starts from is decided before any process group exists (`plan_load`, called by
`startup.prepare`, so a refusal is one line per job), from the config and what is on disk:
  - RESUME: a run's checkpoint, chosen by the resume rule (`resume_rule`): `--load DIR`, or
    `--save DIR`'s own latest; a fine-tune that started from an import and has progress in
    `--save` resumes that progress rather than the import;
  - IMPORT: `--load` names a weights-only checkpoint (a Hugging Face or consolidated import):
    its model weights, from iteration 0 with a new optimizer state, at any data-parallel size;
  - SCRATCH: nothing to load (no directory, or a `--load-optional` one that holds nothing);
and, beside each, the frozen base (`frozen_base.FrozenBase`) whose weights an adapters-only
checkpoint leaves out: the import the run started from, or the model's init.
What is decided once the ranks and the engine exist: whether a RESUME is read as written or
resharded (saved under another data-parallel size, PaRO strategy or bucket layout: only the
engine knows its layout), through `reshard.py`.

The order of a run's loads (`CheckpointManager`): `load_base` puts the import's or the base's
weights into the model before the engine is built (the engine copies them into its fp32
masters and shards), `load` reads the run's checkpoint (or takes the import) and refuses a
`--save` whose `latest` is newer than the start, `restore` puts a run's state into model,
engine, lr schedule and RNGs and gives the trainer its iteration and the sampler's position.
Saves (`due` says when: the interval, the last step, a stop on a signal or time limit) go
through `save`: all ranks agree that every weight is finite, then `save.py` writes
with its atomic protocol; `--save` is probed and locked (`writer.lock`) before any step.
"""

from __future__ import annotations

import dataclasses
import enum
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from megazpp.checkpoint.format import (
    CONFIG_KEY,
    LATEST_FILE,
    MODEL_CONFIG_KEY,
    WEIGHTS_ONLY_KEY,
    LoadedCheckpoint,
    is_two_level,
    is_weights_only,
    latest_checkpoint,
    read_metadata,
)
from megazpp.checkpoint.frozen_base import (
    BASE_KEY,
    FrozenBase,
    base_refusal,
    check_base,
    frozen_names,
    import_base,
    init_base,
    recorded_base,
    without_frozen,
)
from megazpp.checkpoint.load import check_loadable, load_checkpoint, load_model_weights
from megazpp.checkpoint.lock import hold_save_dir
from megazpp.checkpoint.reshard import load_resharded, needs_reshard
from megazpp.checkpoint.resume_check import check_resumable
from megazpp.checkpoint.resume_rule import settings_diff, shown
from megazpp.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megazpp.checkpoint.save import check_not_behind, check_save_dir, save_checkpoint
from megazpp.config.schema import Config
from megazpp.errors import CheckpointError, ConfigError, NumericalError
from megazpp.model.lora import is_adapter
from megazpp.optim.engine_protocol import Engine
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology
from megazpp.state import StateDict

# What a run's checkpoint holds for `restore` (an import holds only the model).
RESUME_KEYS = ("iteration", "consumed_samples", "model", "engine", "lr_schedule", "rng")


class LoadKind(enum.Enum):
    SCRATCH = "scratch"
    RESUME = "resume"
    IMPORT = "import"


@dataclass(frozen=True)
class LoadPlan:
    """What a run starts from, decided once before any rank starts (`plan_load`)."""

    kind: LoadKind
    directory: str | None  # the save directory to load; SCRATCH: a --load holding nothing, or None
    why: str  # why this start, the banner's "start:" line
    base: FrozenBase | None  # where frozen weights come from; None: in the resumed checkpoint


@dataclass(frozen=True)
class Progress:
    """Where a run stands: what the trainer's loop and the sampler continue from."""

    iteration: int
    consumed_samples: int


class ScheduleState(Protocol):
    """What a checkpoint keeps of the lr schedule (`training.lr_schedule.LRSchedule`)."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


def choose_checkpoint(cfg: Config, restarts: int = 0) -> tuple[str | None, str]:
    """(directory to start from or None, why): the resume rule (`resume_rule`).

    When `--load` holds imported weights only (a starting point, no run state) and `--save`
    already holds this run's progress, the run resumes from `--save` instead of starting
    over from the imported weights.
    """
    ck = cfg.checkpoint
    if ck.load:
        if not ck.load_optional:
            check_loadable(ck.load)
        if ck.save and is_weights_only(ck.load) and latest_checkpoint(ck.save):
            return ck.save, f"--save {ck.save} (this fine-tune's progress over --load)"
        return ck.load, f"--load {ck.load}"
    if not ck.save:
        return None, "no --save or --load: starting from scratch"
    try:
        path = latest_checkpoint(ck.save)
    except CheckpointError:
        return ck.save, f"--save {ck.save}"  # damaged: the loader names it or falls back
    if path is None:
        return None, f"--save {ck.save} holds no checkpoint yet: starting from scratch"
    if restarts:
        return ck.save, f"torchrun restart {restarts}"
    saved = read_metadata(path).get(CONFIG_KEY)
    if saved is None:
        raise ConfigError(
            f"--save {ck.save} already holds {path.name}, which records no "
            f"settings: pass --load {ck.save} to continue it, or give another "
            "--save directory to start a new run"
        )
    diff = settings_diff(saved, cfg.to_dict())
    if diff:
        raise ConfigError(
            f"--save {ck.save} already holds {path.name} of a run with other "
            f"settings ({shown(diff)}): pass --load {ck.save} to continue it with "
            "these settings, or give another --save directory to start a new run"
        )
    return ck.save, f"--save {ck.save} (same settings)"


def _weights_only_load(cfg: Config) -> str | None:
    """`--load` when it names an import (the fine-tune flow passes it again when resuming)."""
    load = cfg.checkpoint.load
    try:
        path = latest_checkpoint(load) if load else None
    except CheckpointError:
        return None
    return load if path is not None and read_metadata(path).get(WEIGHTS_ONLY_KEY) else None


def run_base(cfg: Config, load_dir: str | None) -> FrozenBase | None:
    """The base of this run, checked: the one an adapters-only checkpoint in `load_dir`
    records (refused when missing, changed, or another import is given with `--load`), the
    import the run starts from, or the init of a run from scratch. None when the run resumes
    a full checkpoint (its frozen weights are in it); then adapters-only saves are refused."""
    try:
        path = latest_checkpoint(load_dir) if load_dir else None
        meta = read_metadata(path) if path is not None else None
    except CheckpointError:
        path, meta = None, None  # a damaged newest checkpoint: the loader names it or falls back
    if path is not None and meta is not None:
        if meta.get(WEIGHTS_ONLY_KEY):
            return import_base(str(load_dir))
        base = recorded_base(path, meta)
        if base is None:
            if cfg.checkpoint.save_adapters_only:
                raise ConfigError(
                    f"checkpoint.save_adapters_only: this run resumes {path}, a full "
                    "checkpoint, so its frozen weights have no base to record; continue "
                    "it with full checkpoints, or start from the import or the init"
                )
            return None
        given = _weights_only_load(cfg)
        if given is not None and import_base(given) != base:
            raise base_refusal(path, base, f"--load {given} is another base")
        check_base(path, base, cfg.model.init_seed)
        return base
    return init_base(cfg.model.init_seed)


def plan_load(cfg: Config, world_size: int, restarts: int = 0, ranks_per_node: int | None = None) -> LoadPlan:
    """Decide, before any rank starts, what the run loads (the module docstring's kinds):
    refuses a checkpoint this run's layout, model, engine or islands cannot start from
    (`resume_check`; `ranks_per_node`: the launcher's) and an adapters-only resume whose base
    is missing or changed."""
    directory, why = choose_checkpoint(cfg, restarts)
    if directory is not None:
        check_resumable(cfg, directory, world_size, ranks_per_node)
    base = run_base(cfg, directory)
    if directory is None or not (Path(directory) / LATEST_FILE).exists():
        return LoadPlan(LoadKind.SCRATCH, directory, why, base)
    try:
        imported = is_weights_only(directory)
    except CheckpointError:
        if not cfg.checkpoint.load_fallback:
            raise
        imported = False  # a damaged newest checkpoint: the loader falls back from it
    return LoadPlan(LoadKind.IMPORT if imported else LoadKind.RESUME, directory, why, base)


class CheckpointManager:
    """Performs a run's `LoadPlan` on its ranks and its saves; `last` is the newest checkpoint
    it loaded or saved (what a refusal names as the last good one)."""

    def __init__(
        self,
        cfg: Config,
        topology: Topology,
        device: torch.device,
        plan: LoadPlan | None = None,
    ) -> None:
        self.cfg, self.topology, self.device = cfg, topology, device
        self.plan = plan if plan is not None else LoadPlan(LoadKind.SCRATCH, None, "nothing to load", None)
        self.last: Path | None = None
        self._base: LoadedCheckpoint | None = None

    # -- loading --------------------------------------------------------------------------
    def load_base(self, model: nn.Module) -> None:
        """Before the engine is built: the weights of the import the run starts from, or of the
        frozen base an adapters-only checkpoint resumes on (the model keeps its adapters)."""
        base_dir = self.plan.base.load if self.plan.base is not None else None
        if base_dir is None:
            return
        fallback = self.plan.kind is LoadKind.IMPORT and self.cfg.checkpoint.load_fallback
        self._base = load_checkpoint(base_dir, self.topology, fallback=fallback)
        if self._base is not None:
            load_model_weights(model, self._base.state["model"], keep_own=is_adapter)

    def load(self, model: nn.Module, engine: Engine) -> LoadedCheckpoint | None:
        """The checkpoint the run starts from (after `load_base`): the import, or the run's own,
        resharded when its layout differs from `engine`'s; then refuse a `--save` whose
        `latest` is newer than that start (unless told to overwrite or fall back)."""
        loaded: LoadedCheckpoint | None = None
        if self.plan.kind is LoadKind.IMPORT:
            loaded = self._base
        elif self.plan.kind is LoadKind.RESUME:
            loaded = self._resume(model, engine)
        ck = self.cfg.checkpoint
        if ck.save and not (ck.overwrite_newer_checkpoints or ck.load_fallback):
            resumed = loaded is not None and not loaded.weights_only
            check_not_behind(ck.save, int(loaded.metadata["iteration"]) if loaded is not None and resumed else 0)
        return loaded

    def _resume(self, model: nn.Module, engine: Engine) -> LoadedCheckpoint:
        """This run's own checkpoint, resharded when it was written under another data-parallel
        size or PaRO strategy (known only once the engine, and so its layout, exists)."""
        directory = self.plan.directory
        if directory is None:
            raise CheckpointError("a resume needs the directory to resume (LoadPlan.directory)")
        try:
            reshard = needs_reshard(directory, engine, self.topology)
        except CheckpointError:
            # unreadable newest checkpoint: the loader names the damage, or falls back when asked
            reshard = False
        if reshard:
            self._check_reshardable(directory)
            return load_resharded(directory, self.topology, model, engine)
        loaded = load_checkpoint(directory, self.topology, fallback=self.cfg.checkpoint.load_fallback)
        if loaded is None:
            raise CheckpointError(f"{directory}: {LATEST_FILE} names no checkpoint to resume")
        return loaded

    @staticmethod
    def _check_reshardable(directory: str) -> None:
        """Refuse the checkpoints a change of layout cannot carry."""
        path = latest_checkpoint(directory)
        meta = read_metadata(path) if path is not None else {}
        if is_two_level(meta):
            raise CheckpointError(
                f"{path}: a two-level (outer.algorithm {meta[CONFIG_KEY]['outer']['algorithm']}) checkpoint "
                "resumes only under the islands, data-parallel size and strategy that saved it; "
                "export it (the islands' parameters at the last outer sync) and import that"
            )
        if BASE_KEY in meta:
            raise CheckpointError(
                f"{path}: an adapters-only checkpoint resumes only under the data-parallel "
                "size and PaRO strategy that saved it (resharding needs the frozen weights "
                "it leaves out)"
            )

    def restore(self, loaded: LoadedCheckpoint, model: nn.Module, engine: Engine, schedule: ScheduleState) -> Progress:
        """Put the run state of `loaded` (a verified checkpoint of a run, not weights only)
        into model, engine, lr schedule and RNGs; return where the run stands. An
        adapters-only checkpoint lacks the frozen parameters: the model keeps its own (the
        base `load_base` loaded)."""
        state = loaded.state
        missing = [key for key in RESUME_KEYS if key not in state]
        if missing:
            raise CheckpointError(f"{loaded.path}: this rank's file lacks {missing} (not a training checkpoint?)")
        keep_own = frozen_names(model).__contains__ if BASE_KEY in loaded.metadata else None
        load_model_weights(model, state["model"], keep_own=keep_own)
        engine.load_state_dict(state["engine"])
        schedule.load_state_dict(state["lr_schedule"])
        restore_rng_state(state["rng"])
        self.last = loaded.path
        return Progress(int(state["iteration"]), int(state["consumed_samples"]))

    def start_line(self, loaded: LoadedCheckpoint | None, iteration: int) -> str | None:
        """The log line after the banner saying what the run started from (None: the
        banner's start line already said it)."""
        if loaded is None:
            return (
                None
                if self.plan.directory is None
                else f"no checkpoint in {self.plan.directory}: starting from scratch"
            )
        if loaded.weights_only:
            return f"starting from the weights of {loaded.path} (weights only: iteration 0)"
        return f"resumed from {loaded.path} at iteration {iteration}"

    # -- saving ---------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Collective, before step 1: an unwritable `--save` stops the run now, not at a save."""
        if self.cfg.checkpoint.save:
            check_save_dir(self.cfg.checkpoint.save, self.topology)

    def hold_save_dir(self) -> AbstractContextManager[None]:
        """`--save`'s `writer.lock` for the run's life (`lock.py`): one writer per directory."""
        return hold_save_dir(self.cfg.checkpoint.save, self.topology)

    def due(self, iteration: int, exiting: bool) -> bool:
        """Whether the run saves after `iteration`: at the interval, at the last step, and
        whenever it stops early (`exiting`: a signal, the time limit, `exit_interval`)."""
        ck = self.cfg.checkpoint
        return bool(ck.save) and bool(
            (ck.save_interval and iteration % ck.save_interval == 0)
            or exiting
            or iteration == self.cfg.training.train_iters
        )

    def save(self, progress: Progress, model: nn.Module, engine: Engine, schedule: ScheduleState) -> Path:
        """Save, unless a weight is not finite anywhere (all ranks agree before any write, so
        a poisoned state never becomes the `latest` checkpoint); return the checkpoint."""
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        flag = torch.tensor([0.0 if finite else 1.0], device=self.device)  # NCCL: on the GPU
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, tag="checkpoint/finite_check")
        if flag.item():
            raise NumericalError(
                f"iteration {progress.iteration}: refusing to save a checkpoint with non-finite "
                f"weights (rank {self.topology.rank} finite: {finite}); last good checkpoint: "
                f"{self.last or 'none'}"
            )
        if self.cfg.checkpoint.save is None:
            raise ConfigError("saving a checkpoint needs checkpoint.save (--save)")
        self.last = save_checkpoint(
            self.cfg.checkpoint.save,
            progress.iteration,
            self._state(progress, model, engine, schedule),
            self.topology,
            extra_metadata={
                MODEL_CONFIG_KEY: dataclasses.asdict(self.cfg.model),
                CONFIG_KEY: self.cfg.to_dict(),
                **self._base_record(),
            },
            keep_last=self.cfg.checkpoint.keep_last,
        )
        return self.last

    def _state(self, progress: Progress, model: nn.Module, engine: Engine, schedule: ScheduleState) -> StateDict:
        """Everything a resume needs; with `checkpoint.save_adapters_only`, less the frozen
        parameters and their engine buckets (the recorded base has them)."""
        whole = not self.cfg.checkpoint.save_adapters_only
        weights = model.state_dict()
        return {
            "iteration": progress.iteration,
            "consumed_samples": progress.consumed_samples,
            "model": weights if whole else without_frozen(weights, model),
            "engine": engine.state_dict(frozen=whole),
            "lr_schedule": schedule.state_dict(),
            "rng": capture_rng_state(),
        }

    def _base_record(self) -> dict[str, dict[str, str | None]]:
        """metadata.json's record of the base an adapters-only checkpoint needs."""
        if not self.cfg.checkpoint.save_adapters_only:
            return {}
        if self.plan.base is None:
            raise CheckpointError(
                "checkpoint.save_adapters_only: the run has no frozen base (checkpoint.manager.run_base) to record"
            )
        return {BASE_KEY: self.plan.base.record()}
