"""DataOptions: where a run's samples come from, parsed and checked once, when built.

Why here and not in the config: data owns its settings as zero owns `ZeroOptions`. This type
is the `data` config section itself: the config layer reads YAML keys and flags onto its fields
by name (each field's help beside it) before any rank starts; the constructor parses Megatron's
`--data-path` blend and `--split` text here, in the one parser of each, so the dataset builder
and the start-up checks take the parsed `blend` and `fractions` and never parse them again. The
text is kept beside them for the messages that quote what the user wrote. This module never
imports the config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from megazpp.errors import ConfigError, DataError
from megazpp.setting import setting

Blend = tuple[tuple[float, str], ...]  # (weight, dataset prefix) per blend member
Fractions = tuple[float, float, float]  # train, valid, test; they sum to 1


def parse_data_path(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """`["A"]`, `["A", "B"]` (equal weights) or `["0.7", "A", "0.3", "B"]` -> [(weight, prefix)]."""
    items = [str(x) for x in data_path]
    if not items:
        raise DataError("data path is empty: give at least one dataset prefix")

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    if all(number(s) is None for s in items):
        return [(1.0 / len(items), p) for p in items]
    if len(items) % 2 or any(number(w) is None for w in items[::2]) or any(number(p) is not None for p in items[1::2]):
        raise DataError(
            f"data path {items} does not match the 'weight prefix weight prefix ...' form: "
            f"every prefix needs exactly one weight before it"
        )
    weights = [w for w in map(number, items[::2]) if w is not None]  # every one is a number (checked above)
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise DataError(f"data path weights must be positive, got {weights} for prefixes {items[1::2]}")
    return list(zip(weights, items[1::2]))


def parse_split(split: str) -> Fractions:
    """`"969,30,1"` (or `/`-separated; missing parts are 0) -> three fractions summing to 1.
    A refusal names `data.split` and says which rule the weights break."""
    where = "data.split"
    parts = str(split).replace("/", ",").split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"{where} = {split!r}: expected up to three numbers like '969,30,1'") from None
    if len(values) > 3:
        raise ConfigError(f"{where} = {split!r}: expected up to three weights (train,valid,test), got {len(values)}")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ConfigError(f"{where} = {split!r}: expected finite non-negative weights like '969,30,1'")
    if sum(values) <= 0:
        raise ConfigError(
            f"{where} = {split!r}: the weights sum to zero, so no document would go to "
            "any split; give at least one a positive weight (the train one, e.g. '98,2,0')"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return (values[0] / total, values[1] / total, values[2] / total)


@dataclass(frozen=True)
class DataOptions:
    """The `data` section under its own names and defaults. `data_path` and `split` are the
    text as given; `blend` and `fractions` are what they mean, parsed when built (an empty
    `data_path` leaves `blend` empty: tools check configs without data, and a run refuses it,
    `training.startup.check_inputs`)."""

    data_path: list[str] = setting([], "indexed dataset prefix, or a blend: W1 PREFIX1 W2 PREFIX2 ...")
    split: str = setting("969,30,1", "train,valid,test weights of the documents")
    tokenizer_model: str | None = setting(None, "SentencePiece .model file")
    # the embedding is padded to a multiple of this (times TP), as in Megatron
    make_vocab_size_divisible_by: int = setting(128, "pad the vocabulary to a multiple of this x TP")
    # a dataset made by another tokenizer than tokenizer_model is refused unless this is set
    allow_tokenizer_mismatch: bool = setting(
        False, "train on data whose recorded tokenizer (PREFIX.tokenizer.json) is not --tokenizer-model"
    )
    blend: Blend = field(init=False)
    fractions: Fractions = field(init=False)

    def __post_init__(self) -> None:
        """DataError for a `data.data_path` that is not a blend, ConfigError naming the key for
        a split that cannot be cut or a vocabulary multiple below 1; parsed here, once."""
        object.__setattr__(self, "data_path", [str(p) for p in self.data_path])
        object.__setattr__(self, "blend", tuple(parse_data_path(self.data_path)) if self.data_path else ())
        object.__setattr__(self, "fractions", parse_split(self.split))
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError(
                f"data.make_vocab_size_divisible_by = {self.make_vocab_size_divisible_by}: expected a value >= 1"
            )

    @property
    def prefixes(self) -> list[str]:
        return [prefix for _, prefix in self.blend]
