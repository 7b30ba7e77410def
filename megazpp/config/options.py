"""Sections onto the subsystems' options types, by field name: the one mapping of the config.

Why one generic helper: each subsystem owns a typed, checked options type (`zero.options.
ZeroOptions`, `zero.zeropp.ZeroPP`, `optim.options.OptimizerOptions` / `PrecisionOptions`,
`outer.settings.OuterOptions`, `data.options.DataOptions`) whose fields carry the names of its
section's keys, as Megatron-core's DDP config carries its argument names. Mapping by name means a key added to a
section and its options type reaches the subsystem with no code in between, and a field whose
key differs says so once, in its metadata (`key`), beside its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from megazpp.config.schema import ZeroConfig
from megazpp.data.options import DataOptions
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.settings import OuterOptions
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import strategy_setting
from megazpp.zero.zeropp import ZeroPP

T = TypeVar("T")


def options_of(cls: type[T], section: object, **given: Any) -> T:
    """`cls` built from `section`: each field takes `given[name]` when given, else the section's
    value of the field's key (its metadata "key", else its name), else the field's default;
    `cls`'s constructor checks the result (and fills the fields it derives, `init=False`)."""
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        key = f.metadata.get("key", f.name)
        if f.name in given:
            values[f.name] = given[f.name]
        elif hasattr(section, key):
            values[f.name] = getattr(section, key)
    return cls(**values)


def zero_options(z: ZeroConfig, micro_batches_per_step: int | None = None) -> ZeroOptions:
    """The `zero` section as zero's options: `paro_strategy` / `stage` parsed by zero
    (`strategy.strategy_setting`), the ZeRO++ keys onto `ZeroPP`, everything else by name.
    `reduce_scatter` and `contiguous_gradients` have no field: their only accepted values are
    the defaults (`schema.NOT_IMPLEMENTED_YET`)."""
    return options_of(
        ZeroOptions,
        z,
        strategy=strategy_setting(z.paro_strategy, z.stage),
        zeropp=options_of(ZeroPP, z),
        micro_batches_per_step=micro_batches_per_step,
    )


@dataclass(frozen=True)
class RunOptions:
    """Every subsystem's checked options for one run, built once by `config.checks.check_config`
    before any rank starts; the engines are built from these, never from the sections."""

    zero: ZeroOptions
    optimizer: OptimizerOptions
    precision: PrecisionOptions
    outer: OuterOptions | None
    data: DataOptions
