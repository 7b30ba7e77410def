"""A config value as its field's type: the checks YAML, flags and values set in code share.

Why apart from the schema: YAML reads `3e-4` as a string and flags are all strings, so every
value passes one converter that accepts those spellings and refuses anything else in one line
naming where the value came from, with the closest valid choice; the schema and the DeepSpeed
reader use the same wording.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from megazpp.errors import ConfigError


def suggest(name: str, candidates: Iterable[str]) -> str:
    """The hint ` (did you mean 'x'?)` naming the closest of `candidates`, or nothing."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def coerce(value: Any, hint: Any, where: str) -> Any:
    """Check `value` against a field's type hint; accept the string spellings YAML and flags
    produce (YAML reads `3e-4` as a string, flags are all strings)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in options:
                return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where} = {value!r}: invalid")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where} = {value!r}: expected one of {list(choices)}{suggest(str(value), choices)}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        items = value if isinstance(value, list) else [value]
        return [coerce(v, item, where) for v in items]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where} = {value!r}: expected true or false")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r}: expected an integer")
        number = value if isinstance(value, int) else _parse_number(value, where, "an integer")
        if isinstance(number, float) and not number.is_integer():
            raise ConfigError(f"{where} = {value!r}: expected an integer")
        if not -_INT64_LIMIT < number < _INT64_LIMIT:
            raise ConfigError(f"{where} = {_short(value)}: integer out of range")
        return int(number)
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r}: expected a number")
        number = _parse_number(value, where, "a number")
        try:
            number = float(number)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{where} = {_short(value)}: expected a finite number")
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where} = {value!r}: expected a string")
    raise ConfigError(f"{where}: unsupported config type {hint!r}")


_INT64_LIMIT = 2**63


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_number(value: Any, where: str, expected: str) -> float:
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{where} = {value!r}: expected {expected}")
