"""A config section's field with its one line of help beside it, and which fields are keys.

Why here, in the lowest layer: every subsystem defines its own section (a frozen dataclass whose
constructor checks it: `zero.options.ZeroOptions`, `optim.options.OptimizerOptions`, ...), and
the config layer above maps YAML keys, flags, `--help` and `docs/flags.md` onto those fields by
name. Writing the help where the field is defined keeps one place per setting; a field the
config check fills in (`resolved`) or the constructor derives (`init=False`) is not a key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from megazpp.errors import ConfigError

T = TypeVar("T")

RESOLVED = "resolved"  # metadata: filled by the config check from other sections, never a key


def setting(default: T, help: str) -> T:
    """A section field: `default` (a list default is copied per instance) and its help line."""
    if isinstance(default, list):
        items = list(default)
        return dataclasses.field(default_factory=lambda: list(items), metadata={"help": help})  # type: ignore[return-value]
    return dataclasses.field(default=default, metadata={"help": help})


def resolved(default: T, why: str) -> T:
    """A field the config check fills from the rules that span sections; never a key or flag."""
    return dataclasses.field(default=default, metadata={RESOLVED: why})


def keys(section: Any) -> list[dataclasses.Field[Any]]:
    """The fields of a section class (or instance) a YAML file or flag may set."""
    return [f for f in dataclasses.fields(section) if f.init and RESOLVED not in f.metadata]


def help_of(f: dataclasses.Field[Any]) -> str:
    """A key's help line ('' when it has none: a test requires one for every key)."""
    return str(f.metadata.get("help", ""))


def require_positive(key: str, value: int | float | None) -> None:
    """Refuse a set value that is not > 0, naming its key (`training.train_iters`); None passes
    (a key whose absence means "derive it" or "off")."""
    if value is not None and not value > 0:
        raise ConfigError(f"{key} = {value!r}: expected a value > 0")
