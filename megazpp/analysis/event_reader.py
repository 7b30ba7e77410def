"""Reads one run's TensorBoard event files into step-aligned arrays and its logged config.

Why TensorBoard's own reader (EventAccumulator): the event format (CRC-framed protobuf
records, float32 scalars) is TensorBoard's, and its reader already drops the points that a
resumed run rewrote ("orphaned" steps after a restart), so a run reads the way TensorBoard
shows it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from megazpp.errors import DataError
from megazpp.unique_keys import JSONObject

EVENT_FILE_GLOB = "events.out.tfevents.*"
# The trainer logs its resolved config with `add_text("config", ...)`; the text plugin
# stores it under this tensor tag.
CONFIG_TEXT_TAG = "config/text_summary"


@dataclass(frozen=True)
class Series:
    """One scalar tag: strictly increasing steps and their values."""

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def within(self, first: int, last: int) -> Series:
        keep = (self.steps >= first) & (self.steps <= last)
        return Series(self.steps[keep], self.values[keep])


@dataclass(frozen=True)
class Run:
    """A run as read back: its label, where its events were, its scalars and config."""

    label: str
    directory: Path
    scalars: dict[str, Series]
    config: JSONObject | None  # the logged config, sections of settings


def read_run(run_dir: str | Path, label: str) -> Run:
    """Read every scalar tag and the logged config of the run under `run_dir`."""
    directory, accumulator = _locate(Path(run_dir))
    tags = accumulator.Tags()
    scalars = {tag: _series(accumulator.Scalars(tag)) for tag in tags["scalars"]}
    config = _config(accumulator) if CONFIG_TEXT_TAG in tags["tensors"] else None
    return Run(label, directory, scalars, config)


def read_runs(run_dir: str | Path, label: str) -> list[Run]:
    """The runs under `run_dir`: one, or several when later runs wrote into the same
    directory (TensorBoard would merge them into one curve, purging the older points).

    What makes two event files one run is the checkpoint between them: a file that starts
    after step 1 (a resumed attempt) continues the run whose `checkpoint.save` it resumed from
    (its `checkpoint.load`, or its own `save` when it resumed by itself), never merely the run
    logged before it: a test or another job logging into the same directory once cut the
    user's 300-step run at step 12 and appended its own steps. A file that starts at step 1
    continues a run only with the same config (a restart before the first checkpoint).
    Files without a logged config (an old or foreign run) continue the latest run, as
    TensorBoard shows them. Several runs are labelled `label#1`, `label#2`, ... oldest first.
    """
    directory, _ = _locate(Path(run_dir))
    groups: list[_FileGroup] = []
    for start in sorted(_file_starts(directory), key=lambda start: (start.wall, str(start.path))):
        group = _continued(groups, start)
        if group is None:
            group = _FileGroup()
            groups.append(group)
        group.files.append(start.path)
        if start.config is not None:
            group.config = start.config
            group.saves.add(start.config.save)
    if len(groups) <= 1:
        return [read_run(directory, label)]
    return [_merged_run(group.files, f"{label}#{i}", directory) for i, group in enumerate(groups, 1)]


@dataclass(frozen=True)
class _LoggedConfig:
    """What of a file's logged config says which run it belongs to."""

    text: str  # the whole config as logged: equal texts are the same settings
    save: str | None  # checkpoint.save, normalised: where the run's checkpoints went
    resumed_from: str | None  # checkpoint.load, else save: where a resumed attempt read its state


@dataclass(frozen=True)
class _FileStart:
    wall: float  # wall time of its first event
    step: int | None  # first scalar step
    config: _LoggedConfig | None
    path: Path


@dataclass
class _FileGroup:
    """One run's event files in write order, its latest logged config and where it saved."""

    files: list[Path] = field(default_factory=list)
    config: _LoggedConfig | None = None
    saves: set[str | None] = field(default_factory=set)


def _continued(groups: list[_FileGroup], start: _FileStart) -> _FileGroup | None:
    """The run the file `start` continues, or None when it begins a new one (`read_runs`)."""
    if not groups:
        return None
    if start.config is None or all(group.config is None for group in groups):
        return groups[-1]
    if start.step is not None and start.step > 1:
        source = start.config.resumed_from
        matches = [group for group in groups if source is not None and source in group.saves]
    else:
        matches = [group for group in groups if group.config is not None and group.config.text == start.config.text]
    return matches[-1] if matches else None


def _file_starts(directory: Path) -> list[_FileStart]:
    """Where each event file starts: its first wall time and step, and its logged config."""
    starts = []
    for path in directory.glob(EVENT_FILE_GLOB):
        wall, step, config = None, None, None
        for event in EventFileLoader(str(path)).Load():
            wall = event.wall_time if wall is None else wall
            for value in event.summary.value:
                if value.tag == CONFIG_TEXT_TAG and config is None:
                    config = _logged_config(tensor_util.make_ndarray(value.tensor).reshape(-1)[0])
                elif value.tag != CONFIG_TEXT_TAG and step is None and event.step > 0:
                    step = event.step
            if step is not None:
                break
        starts.append(_FileStart(wall or 0.0, step, config, path))
    return starts


def _logged_config(raw: bytes | str) -> _LoggedConfig:
    text = _text(raw)
    parsed = _parse_config_text(text)
    checkpoint = parsed.get("checkpoint") if parsed is not None else None
    save = load = None
    if isinstance(checkpoint, dict):
        save, load = _directory(checkpoint.get("save")), _directory(checkpoint.get("load"))
    return _LoggedConfig(text, save, load if load is not None else save)


def _directory(value: object) -> str | None:
    return os.path.normpath(value) if isinstance(value, str) and value else None


def _merged_run(files: list[Path], label: str, directory: Path) -> Run:
    """One run from its event files in write order: a later file replaces the points from its
    first step on (what a resumed attempt rewrote)."""
    scalars: dict[str, Series] = {}
    config = None
    for path in files:
        accumulator = _load(path)
        tags = accumulator.Tags()
        for tag in tags["scalars"]:
            new = _series(accumulator.Scalars(tag))
            old = scalars.get(tag)
            if old is not None and len(new):
                old = old.within(int(old.steps[0]) if len(old) else 0, int(new.steps[0]) - 1)
                new = Series(np.concatenate([old.steps, new.steps]), np.concatenate([old.values, new.values]))
            scalars[tag] = new
        if CONFIG_TEXT_TAG in tags["tensors"]:
            config = _config(accumulator)
    return Run(label, directory, scalars, config)


def _locate(run_dir: Path) -> tuple[Path, event_accumulator.EventAccumulator]:
    """The run's event directory, loaded: `run_dir` itself, or the one directory below it
    that holds events with scalars (a run dir whose TensorBoard output sits in a
    subdirectory, e.g. `RUN/tensorboard/`)."""
    if not run_dir.is_dir():
        raise DataError(
            f"run directory {run_dir} does not exist or is not a directory "
            f"(expected a directory holding TensorBoard event files {EVENT_FILE_GLOB})"
        )
    if any(p.is_file() for p in run_dir.glob(EVENT_FILE_GLOB)):
        return run_dir, _load(run_dir)
    candidates = sorted({p.parent for p in run_dir.rglob(EVENT_FILE_GLOB) if p.is_file()})
    if not candidates:
        raise DataError(
            f"run directory {run_dir} holds no TensorBoard event files "
            f"({EVENT_FILE_GLOB}); was logging.tensorboard_dir set for that run?"
        )
    loaded = [(d, _load(d)) for d in candidates]
    with_scalars = [(d, acc) for d, acc in loaded if acc.Tags()["scalars"]]
    if len(with_scalars) != 1:
        found = ", ".join(str(d) for d, _ in (with_scalars or loaded))
        raise DataError(
            f"run directory {run_dir} does not hold exactly one directory of "
            f"event files with scalars (found: {found}); pass that directory itself"
        )
    return with_scalars[0]


def _load(directory: Path) -> event_accumulator.EventAccumulator:
    # Size guidance 0 keeps every point: the default reservoir samples scalars down to
    # 10,000, which would make "final" and "best" depend on chance for long runs.
    accumulator = event_accumulator.EventAccumulator(
        str(directory), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    try:
        accumulator.Reload()
    except Exception as exc:  # the reader raises assorted protobuf / IO errors
        raise DataError(f"cannot read the TensorBoard event files in {directory}: {exc}") from exc
    return accumulator


def _series(events: list[event_accumulator.ScalarEvent]) -> Series:
    """Sort by step; when a step was written twice (a restart the reader did not purge),
    keep the later write, which is what the resumed run actually trained."""
    steps = np.array([e.step for e in events], dtype=np.int64)
    values = np.array([e.value for e in events], dtype=np.float64)
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    last_of_each = np.append(steps[1:] != steps[:-1], True)
    return Series(steps[last_of_each], values[last_of_each])


def _config(accumulator: event_accumulator.EventAccumulator) -> JSONObject | None:
    """The last logged config text, parsed back from its ```yaml fence; None when the text
    is not a YAML mapping (an old or foreign run), since losses can be compared without it."""
    latest = accumulator.Tensors(CONFIG_TEXT_TAG)[-1]
    raw = tensor_util.make_ndarray(latest.tensor_proto).reshape(-1)[0]
    return _parse_config_text(_text(raw))


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


def _parse_config_text(text: str) -> JSONObject | None:
    body = "\n".join(line for line in text.strip().splitlines() if not line.startswith("```"))
    try:
        parsed = yaml.safe_load(body)
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, dict) else None
