"""Each run-level section (`training`, `checkpoint`, `logging`, `parallel`) is a frozen type that
refuses its own bad values when built, naming the key, so no caller holds an unchecked one; the
loader says which source set a refused key."""

from __future__ import annotations

import dataclasses

import pytest

from megazpp.config.load import load_config
from megazpp.config.sections import CheckpointOptions, LoggingOptions, TrainingOptions
from megazpp.errors import ConfigError
from megazpp.parallel.options import ParallelOptions

BAD = [
    (TrainingOptions, {"train_iters": 0}, r"training\.train_iters = 0: expected a value > 0"),
    (TrainingOptions, {"micro_batch_size": -1}, r"training\.micro_batch_size = -1: expected a value > 0"),
    (TrainingOptions, {"loss_spike_factor": 0.5}, r"training\.loss_spike_factor = 0\.5: expected 0 \(off\)"),
    (TrainingOptions, {"lr_warmup_fraction": 1.5}, r"training\.lr_warmup_fraction = 1\.5: expected a fraction"),
    (TrainingOptions, {"lr_warmup_fraction": 0.1, "lr_warmup_iters": 3}, r"are both set: give one"),
    (TrainingOptions, {"lr_warmup_iters": 200}, r"lr_warmup_iters = 200 exceeds the decay length .* = 100"),
    (CheckpointOptions, {"save_interval": 0}, r"checkpoint\.save_interval = 0: expected a value > 0"),
    (CheckpointOptions, {"keep_last": 0}, r"checkpoint\.keep_last = 0: expected a value > 0"),
    (CheckpointOptions, {"keep_last": 1, "load_fallback": True}, r"keep_last 1 removes; keep at least 2"),
    (LoggingOptions, {"log_interval": 0}, r"logging\.log_interval = 0: expected a value > 0"),
    (ParallelOptions, {"distributed_timeout_minutes": 0}, r"parallel\.distributed_timeout_minutes = 0"),
    (ParallelOptions, {"sequence_parallel": True}, r"sequence_parallel = true needs parallel\.tensor_model_parallel"),
]


@pytest.mark.parametrize("cls,values,message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_a_section_refuses_its_own_bad_values_when_built(cls, values, message):
    with pytest.raises(ConfigError, match=message):
        cls(**values)


def test_sections_are_frozen_and_replace_checks_again():
    t = TrainingOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.train_iters = 5
    with pytest.raises(ConfigError, match=r"training\.eval_interval = 0"):
        dataclasses.replace(t, eval_interval=0)
    # a warmup fraction resolves against the decay length
    assert TrainingOptions(train_iters=40, lr_warmup_fraction=0.25).warmup_iters == 10


def test_the_loader_names_the_source_of_a_refused_key():
    with pytest.raises(ConfigError, match=r"^command line: logging\.log_interval = 0"):
        load_config(["--log-interval", "0"])
