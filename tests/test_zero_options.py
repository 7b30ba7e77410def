"""A ZeRO setting's walk: from the config to where it acts, checked once, before any rank.

`zero/options.py` (`ZeroOptions`) and `zero/zeropp.py` (`ZeroPP`) check every rule of the
`zero` section when built, naming the key; the config maps the section onto them once
(`config.checks.check_config`); the engine takes them as built and the kernels check their
arguments as arguments (ValueError, no config key). With `paro_strategy: auto` the rules that
need the strategy narrow what the planner may choose, so nothing is left to fail on the ranks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_reliability_inputs import pretrain, refused

import megazpp.zero.options
import megazpp.zero.zeropp
from kernels import reference
from megazpp.config.checks import check_config
from megazpp.config.schema import Config
from megazpp.errors import ConfigError, MegazppError
from megazpp.launch.local_ranks import run_ranks
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel.topology import Topology, dp_groups
from megazpp.zero.options import NOT_IMPLEMENTED_YET, ZeroOptions
from megazpp.zero.strategy import VALID_STRATEGIES, Level, PlannerChoice, parse_strategy
from megazpp.zero.zero_engine import ZeroEngine
from megazpp.zero.zeropp import ZeroPP


def test_zero_rules_under_auto_are_refused_by_pretrain_before_any_rank(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"  # as a user writes LoCo's block, with a beta outside [0, 1]
    ds.write_text(
        json.dumps({"zero_optimization": {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.5}}})
    )
    # two ranks announced but no rendezvous address: had pretrain_gpt.py reached its process
    # group it would have failed there, with a traceback instead of the one-line refusal
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "tiny.yaml"  # no data or tokenizer: the refusals come before inputs are read
    config.write_text(
        "model: {arch: llama, num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_query_groups: 2,"
        " seq_length: 16, vocab_size: 256}\ntraining: {micro_batch_size: 2, global_batch_size: 4}\n"
    )
    auto = ["--config", str(config), "--paro-strategy", "auto"]
    line = refused(pretrain(*auto, "--deepspeed_config", str(ds)))
    assert line.endswith("zero.loco_err_beta (zeropp_loco_param.err_beta): LoCo err_beta=1.5 must lie in [0, 1]")
    # LoCo without qgZ: this rule ran only once the planner had chosen, on the ranks
    line = refused(pretrain(*auto, "--loco"))
    assert line.endswith(
        "zero.loco (zeropp_loco_param): LoCo corrects qgZ's 4-bit gradients; "
        "it needs zero.zero_quantized_gradients = true"
    )
    # qwZ needs p sharded, frozen LoRA weights need p = N with qwZ: no strategy runs both, and
    # the planner used to pick a p-sharded one that the engine then refused on every rank
    line = refused(pretrain(*auto, "--zero-quantized-weights", "--lora-rank", "2"))
    assert "zero.paro_strategy = auto: no strategy fits the settings" in line
    assert "with qwZ / hpZ and frozen parameters" in line


def test_auto_allows_only_the_strategies_the_zero_settings_accept():
    every = ZeroOptions(paro_strategy="auto")
    assert isinstance(every.strategy, PlannerChoice) and every.strategy.allowed == VALID_STRATEGIES
    zero = check_config(
        Config(
            zero=ZeroOptions(paro_strategy="auto", zero_quantized_gradients=True, stage3_param_persistence_threshold=10)
        ),
        1,
    ).zero
    assert isinstance(zero.strategy, PlannerChoice)
    expected = [s for s in VALID_STRATEGIES if s.params != Level.N and s.grads != Level.N]
    assert list(zero.strategy.allowed) == expected
    assert {s.name for s in expected} == {"III", "IIG", "IGG", "GIG", "GGG"}
    assert zero.chosen(expected[0]).resolved == expected[0]
    with pytest.raises(ValueError, match="not among the strategies the settings allow"):
        zero.chosen(parse_strategy("NNN"))  # a planner bug, not user input


@pytest.mark.parametrize(
    ("zero", "key"),
    [
        ({"stage": 3, "zero_quantized_gradients": True, "loco": True, "loco_err_beta": 1.5}, "zero.loco_err_beta"),
        ({"stage": 3, "zero_quantized_gradients": True, "qgz_block_size": 7}, "zero.qgz_block_size"),
        ({"stage": 3, "loco_reset_t": 0}, "zero.loco_reset_t"),
        ({"stage": 1, "zero_quantized_weights": True}, "zero_quantized_weights"),
        ({"stage": 2, "stage3_param_persistence_threshold": 5}, "zero.stage3_param_persistence_threshold"),
        ({"paro_strategy": "auto", "loco": True}, "zero.loco"),
    ],
)
def test_zero_rules_are_raised_by_zeros_own_options_only(zero, key):
    """The refusal names the key and comes from zero's options (the section's own type, checked
    when built), not from the config's checks; as YAML or flags set it, the loader builds it."""
    with pytest.raises(ConfigError, match=key) as info:
        ZeroOptions(**zero)
    raised_in = Path(info.traceback[-1].path).as_posix()
    assert raised_in.endswith(("megazpp/zero/options.py", "megazpp/zero/zeropp.py")), raised_in


def test_kernels_speak_of_arguments_not_config_keys():
    grad = torch.ones(8)
    err = torch.zeros(8)
    for call, words in (
        (lambda: reference.loco_quantize(grad, err, 1.5, 8), "err_beta=1.5"),
        (lambda: reference.quantize(grad, 4, 7), "block_size=7"),
    ):
        with pytest.raises(ValueError, match=words) as info:
            call()
        assert not isinstance(info.value, MegazppError) and "zero." not in str(info.value)


def _engine_rank() -> list[float]:
    """An engine with qgZ + LoCo built from options, then a step, with every options check
    replaced by a failure: nothing after the options' construction checks them again."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    topology = Topology.from_env(1, 1, 1)
    options = ZeroOptions(
        paro_strategy="NGG",
        micro_batches_per_step=1,
        zero_quantized_gradients=True,
        loco=True,
        qgz_block_size=8,
    )

    def checked_again(*_: object) -> None:
        raise AssertionError("a zero setting was checked again after its options were built")

    megazpp.zero.options.ZeroOptions.__post_init__ = checked_again  # type: ignore[method-assign]
    megazpp.zero.zeropp.ZeroPP.__post_init__ = checked_again  # type: ignore[method-assign]
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    engine = ZeroEngine(model, OptimizerOptions(lr=1e-2), PrecisionOptions(), options, topology)
    losses = []
    for _ in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(topology.dp_rank))
        loss = model(x).square().mean()
        engine.scale_loss(loss).backward()
        engine.step()
        engine.zero_grad()
        losses.append(float(loss))
    engine.close()
    return losses


@pytest.mark.multirank
def test_the_engine_takes_its_options_as_built():
    results = run_ranks(_engine_rank, 2, timeout_s=120)
    assert all(len(r) == 2 for r in results)


def test_every_zeropp_field_is_read_from_a_zero_key():
    """The `zero` section is ZeroOptions itself; the ZeRO++ paths take `ZeroPP`, built from the
    section's keys its fields name, so no key reaches zero under a second name, and each
    refused key (not implemented) is one of the section's."""
    from megazpp.setting import keys

    # the strategy is derived from the keys when built, so a replaced key re-derives it
    assert dataclasses.replace(ZeroOptions(reduce_bucket_size=5), stage=3).resolved.name == "GGG"
    section = {f.name for f in keys(ZeroOptions)}
    assert {f.metadata["key"] for f in dataclasses.fields(ZeroPP)} <= section
    assert set(NOT_IMPLEMENTED_YET) <= section
    for name in NOT_IMPLEMENTED_YET:
        with pytest.raises(ConfigError, match=f"zero.{name} = False: .*not implemented yet"):
            ZeroOptions(**{name: False})


def test_hpz_group_against_the_nodes_is_checked_before_any_rank():
    """hpZ's group must lie inside one node: a rule of the `zero` section that needs the ranks'
    layout over the nodes, checked by the config for every DP group (`topology.dp_groups`)
    with the function the engine resolves its group size by."""
    assert dp_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # rank = tp + 2 * (dp + 2 * pp)
    assert dp_groups(8, 2, 2, islands=2) == [[0], [2], [1], [3], [4], [6], [5], [7]]
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    cfg.training = dataclasses.replace(cfg.training, micro_batch_size=1, global_batch_size=6)
    cfg.zero = ZeroOptions(
        stage=3, zero_hpz_partition_size=2
    )  # 6 DP ranks, 3 per node: ranks 2 and 3 would share a group
    with pytest.raises(ConfigError, match=r"group of DP ranks \[2, 3\] spans nodes \[0, 1\]"):
        check_config(cfg, world_size=6, ranks_per_node=3)
    cfg.zero = ZeroOptions(stage=3, zero_hpz_partition_size=3)  # one group per node
    assert check_config(cfg, world_size=6, ranks_per_node=3).zero.zeropp.hpz == 3
    cfg.zero = ZeroOptions(
        stage=3, zero_hpz_partition_size=16
    )  # the tutorial's: lowered to the node's 3 ranks, as the engine does
    check_config(cfg, world_size=6, ranks_per_node=3)
