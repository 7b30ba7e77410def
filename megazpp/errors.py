"""The project's own exceptions.

Every error a user can cause (bad config, bad data, bad checkpoint) is raised as a subclass of
`MegazppError`, so callers and hostile-input tests can tell "the project refused this input
with a message" apart from a crash.
"""

import os
from typing import TypeVar

T = TypeVar("T")


class MegazppError(Exception):
    """Base class of every error megazpp raises on purpose."""


class ConfigError(MegazppError, ValueError):
    """A configuration key, flag or value is unknown, invalid or inconsistent."""


class DataError(MegazppError, ValueError):
    """An input data file (JSONL, .bin/.idx, tokenizer model, blend spec) is unusable."""


class CheckpointError(MegazppError, RuntimeError):
    """A checkpoint is missing, incomplete or inconsistent."""


class TopologyError(MegazppError, ValueError):
    """A parallel layout does not fit the world size or the model."""


class CommunicationError(MegazppError, RuntimeError):
    """A collective or point-to-point operation failed or timed out (a peer died or hung)."""


class NumericalError(MegazppError, RuntimeError):
    """Training produced non-finite losses or gradients for too many consecutive steps."""


class LaunchError(MegazppError, RuntimeError):
    """The launch environment (SLURM variables, a hostfile, the nodes' files) is unusable or
    the nodes of one job disagree."""


# The one rule of every tool that writes a result (an export, a preprocessed dataset): what is
# already there is never overwritten; the user picks a new name or removes the old one.
NEVER_OVERWRITE = "outputs are never overwritten"


def refuse_existing(
    existing: "str | os.PathLike[str]",
    error: type[MegazppError],
    *,
    found: str = "already exists",
    instead: str = "choose a new name",
) -> None:
    """Raise `error` naming `existing` when that path exists (see NEVER_OVERWRITE)."""
    if os.path.lexists(existing):
        raise error(f"{os.fspath(existing)}: {found}; {instead} ({NEVER_OVERWRITE})")


def required(value: T | None, key: str) -> T:
    """`value` of config key `key`, one the config fills itself (ModelConfig's None fields are
    derived from its arch on construction, the global batch size in the checked config that
    `config.checks.check_config` returns)."""
    if value is None:
        raise ConfigError(f"{key} is unset: the config resolves it when built and validated")
    return value
