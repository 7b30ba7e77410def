"""YAML and JSON readers that refuse a key given twice in one mapping, at any depth.

Why: both formats let the last of two equal keys win without a word, so a config file with a
second `model:` section silently drops every key of the first (its `hidden_size` included),
and a DeepSpeed JSON with two `zero_optimization` blocks keeps only one. A duplicate is
almost always an editing accident, so it is refused with both line numbers.

The one name of JSON read from (or written to) a file: `JSONObject`. Why its values stay
untyped: a file's values are whatever its writer (or a user) put there, read back by key by the
code that knows the format, which checks what it reads; a recursive value type would need a
cast or a check at every read and check nothing the reader does not already.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any, TypeAlias

import yaml

JSONObject: TypeAlias = dict[str, Any]


class UniqueKeySafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` (plain data only) that raises on a repeated mapping key."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first_line: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class refuses it with its message
                continue
            if line != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r} at lines {line} and {key_node.start_mark.line + 1}"
                )
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> object:
    """Parse YAML as plain data (the caller checks its shape); a repeated key raises
    `yaml.YAMLError` naming both lines."""
    return yaml.load(text, Loader=UniqueKeySafeLoader)


class DuplicateKeyError(ValueError):
    """A JSON object names the same key twice."""


def _unique_pairs(pairs: list[tuple[str, object]]) -> JSONObject:
    out: JSONObject = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"duplicate key {key!r} in one JSON object")
        out[key] = value
    return out


def load_json(text: str) -> object:
    """`json.loads` that raises `DuplicateKeyError` (a ValueError) on a repeated key; the
    caller checks the shape of what it gets."""
    return json.loads(text, object_pairs_hook=_unique_pairs)
