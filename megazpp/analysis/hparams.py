"""The resolved config as TensorBoard hparams, so `tensorboard --logdir runs/` lines runs up
by their settings in the HPARAMS tab.

Why only the session-start record and no "experiment" record: with several runs under one
logdir, TensorBoard takes the first experiment record it finds and ignores the others, so a
per-run experiment would hide the keys of every other run. Without one, TensorBoard builds
the experiment from all runs' session records and offers every scalar tag as a metric.
Why in the run's own directory (unlike SummaryWriter.add_hparams, which opens a new
timestamped subdirectory): the hparams then belong to the run whose scalars sit beside them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tensorboard.plugins.hparams import summary_v2

if TYPE_CHECKING:  # torch is imported by the trainer that hands the writer in, not here
    from torch.utils.tensorboard import SummaryWriter

HParamValue = bool | int | float | str


def hparams_from_config(cfg: Mapping[str, object]) -> dict[str, HParamValue]:
    """Flatten a nested config to dotted keys with scalar values ("model.hidden_size": 64).

    None is left out (TensorBoard has no null hparam, and a blank cell reads as "unset");
    lists and other values become JSON / str text, since hparams hold only scalars.
    """
    flat: dict[str, HParamValue] = {}
    _flatten(cfg, "", flat)
    return flat


def _flatten(node: Mapping[str, object], prefix: str, out: dict[str, HParamValue]) -> None:
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, f"{name}.", out)
        elif value is None:
            continue
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(list(value), default=str)
        else:
            out[name] = str(value)


def write_hparams(writer: SummaryWriter, cfg: Mapping[str, object]) -> None:
    """Record `cfg` as this run's hparams through an open torch SummaryWriter."""
    file_writer = writer.file_writer
    if file_writer is None:  # SummaryWriter.close() drops it
        raise ValueError("write_hparams: the SummaryWriter is closed")
    file_writer.add_summary(summary_v2.hparams_pb(hparams_from_config(cfg)), 0)
