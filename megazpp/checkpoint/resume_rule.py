"""The resume rule: whether a run continues the checkpoint already in its `--save` directory.

A run continues the checkpoint in a directory when
  - `--load DIR` names it (whatever the settings: the user asked for it); or
  - there is no `--load`, `--save DIR` holds a checkpoint, and either this attempt is a
    restart by torchrun (`TORCHELASTIC_RESTART_COUNT` > 0) or the checkpoint's saved config
    equals this run's in everything but `RUN_ONLY_KEYS` (where checkpoints and logs go, how
    often, when to stop, timeouts).
Otherwise a checkpoint in `--save` is refused by name, with the settings that differ and the
two ways on: `--load DIR` to continue it with the new settings, or another `--save` to start
a new run (a new run never writes into another run's directory). The rule is applied by
`manager.plan_load`; this module says which settings count.
"""

from __future__ import annotations

from megazpp.config.schema import Config
from megazpp.unique_keys import JSONObject

# Settings a continued run may change: where checkpoints and logs go and how often, when to
# stop, how long a collective may wait, the transport and compilation, whether a tokenizer
# mismatch is accepted, whether the memory check runs. Everything else shapes the run's state.
RUN_ONLY_KEYS = (
    "checkpoint.",
    "logging.",
    "parallel.distributed_timeout_minutes",
    "parallel.distributed_backend",
    "training.compile",
    "data.allow_tokenizer_mismatch",
    "training.skip_memory_check",
)


def _flatten(config: dict[str, JSONObject]) -> JSONObject:
    return {f"{section}.{key}": value for section, body in config.items() for key, value in body.items()}


def settings_diff(saved: dict[str, JSONObject], current: dict[str, JSONObject]) -> list[str]:
    """`key saved -> current` for every setting outside RUN_ONLY_KEYS that differs. A key the
    saved run did not have yet (a section or setting added since) counts as its default."""
    old, new = _flatten(saved), _flatten(current)
    defaults = _flatten(Config().to_dict())
    old.update({k: defaults[k] for k in new if k not in old and k in defaults})
    keys = [k for k in dict.fromkeys([*new, *old]) if not k.startswith(RUN_ONLY_KEYS)]
    return [f"{k} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys if old.get(k) != new.get(k)]


def shown(diff: list[str], most: int = 4) -> str:
    """The first `most` differences of a refusal, and how many more there are."""
    return "; ".join(diff[:most]) + (f"; and {len(diff) - most} more" if len(diff) > most else "")
