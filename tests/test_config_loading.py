"""Config loading: YAML + flags + DeepSpeed JSON, and every kind of bad input refused with
its message before any work starts."""

from __future__ import annotations

import json

import pytest

from megazpp.config.checks import validate_config
from megazpp.config.load import load_config
from megazpp.errors import ConfigError
from megazpp.zero.options import NOT_IMPLEMENTED_YET

BASE_YAML = """\
model: {arch: llama, num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_query_groups: 2}
training: {micro_batch_size: 2, global_batch_size: 8, train_iters: 10, lr_warmup_iters: 2}
optimizer: {lr: 3e-4, min_lr: 3.0e-5}
"""


@pytest.fixture()
def base_yaml(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(BASE_YAML)
    return str(path)


def write_json(tmp_path, obj) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_yaml_then_flags_precedence_and_types(base_yaml):
    cfg = validate_config(
        load_config(
            [
                "--config",
                base_yaml,
                "--lr",
                "1e-3",
                "--hidden-size",
                "128",
                "--bf16",
                "--data-path",
                "0.3",
                "A",
                "0.7",
                "B",
                "--activation-checkpointing",
                "--no-activation-checkpointing",
                "--split",
                "90,10,0",
            ]
        ),
        1,
    )
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.min_lr == 3e-5  # "3e-4" string parsed
    assert cfg.model.hidden_size == 128 and cfg.model.num_query_groups == 2
    assert cfg.precision.bf16 is True and cfg.precision.fp16 is False
    assert cfg.model.activation_checkpointing is False  # the later flag wins
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"]
    assert cfg.training.global_batch_size == 8 and cfg.num_micro_batches(1) == 4


def test_unknown_yaml_key_suggests_and_names_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model: {hiden_size: 64}\n")
    with pytest.raises(
        ConfigError,
        match=r"typo\.yaml: unknown key model\.hiden_size "
        r"\(did you mean 'hidden_size'\?\)",
    ):
        load_config(["--config", str(path)])
    path.write_text("model: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match="belongs in section 'optimizer'"):
        load_config(["--config", str(path)])
    path.write_text("modle: {}\n")
    with pytest.raises(ConfigError, match=r"unknown section 'modle' \(did you mean 'model'\?\)"):
        load_config(["--config", str(path)])
    path.write_text("training: {train_iters: many}\n")
    with pytest.raises(ConfigError, match=r"training\.train_iters = 'many': expected an integer"):
        load_config(["--config", str(path)])


def test_unknown_flag_suggests():
    with pytest.raises(ConfigError, match=r"unknown flag --hidden-sise \(did you mean '--hidden-size'\?\)"):
        load_config(["--hidden-sise", "64"])
    with pytest.raises(ConfigError, match=r"unknown flag --micro-batch \(did you mean '--micro-batch-size'\?\)"):
        load_config(["--micro-batch", "2"])


def test_inconsistent_values_rejected(base_yaml):
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size = 10 is not divisible by "
        r"micro_batch_size 4 x data-parallel size 2 = 8",
    ):
        validate_config(load_config(["--config", base_yaml, "--micro-batch-size", "4", "--global-batch-size", "10"]), 2)
    with pytest.raises(
        ConfigError,
        match=r"hidden_size = 66 is not divisible by "
        r"model\.num_attention_heads = 4",
    ):
        validate_config(load_config(["--config", base_yaml, "--hidden-size", "66"]))
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        validate_config(load_config(["--config", base_yaml, "--tensor-model-parallel-size", "2"]), 3)
    with pytest.raises(ConfigError, match="bf16 and precision.fp16 are both set"):
        validate_config(load_config(["--config", base_yaml, "--bf16", "--fp16"]))
    with pytest.raises(ConfigError, match=r"min_lr = 0\.5 must lie in \[0, optimizer\.lr"):
        validate_config(load_config(["--config", base_yaml, "--min-lr", "0.5"]))
    with pytest.raises(ConfigError, match=r"lr_decay_style = 'cosin'.*did you mean 'cosine'"):
        load_config(["--config", base_yaml, "--lr-decay-style", "cosin"])
    with pytest.raises(ConfigError, match=r"zero\.qgz_block_size: quantization block_size=7 is invalid"):
        validate_config(load_config(["--config", base_yaml, "--qgz-block-size", "7"]))
    with pytest.raises(ConfigError, match=r"zero\.cpu_quant_kernels = 'fast': expected one of 'reference', 'compiled'"):
        validate_config(load_config(["--config", base_yaml, "--cpu-quant-kernels", "fast"]))


def test_deepspeed_config_mapping(tmp_path, base_yaml):
    ds = write_json(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "gradient_clipping": 0.5,
            "steps_per_print": 5,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 1e-3, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.05},
            },
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 2,
                "min_loss_scale": 2,
            },
            "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 2e8,
                "contiguous_gradients": True,
                "overlap_comm": True,
                "allgather_partitions": True,
                "stage3_module_granularity_threshold": 1000,
                "stage3_max_live_parameters": 3e8,
                "stage3_max_reuse_distance": 2e8,
                "stage3_prefetch_bucket_size": 1e7,
            },
        },
    )
    cfg = validate_config(load_config(["--config", base_yaml, "--deepspeed_config", ds]), 1)
    o, p, t = cfg.optimizer, cfg.precision, cfg.training
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == (
        1e-3,
        0.8,
        0.9,
        1e-6,
        0.05,
        0.5,
    )
    assert (p.fp16, p.initial_loss_scale, p.loss_scale_window, p.hysteresis, p.min_loss_scale) == (
        True,
        4096.0,
        500,
        2,
        2.0,
    )
    assert (t.micro_batch_size, t.global_batch_size, cfg.logging.log_interval) == (2, 8, 5)
    z = cfg.zero
    assert (
        z.stage,
        z.reduce_bucket_size,
        z.module_granularity_threshold,
        z.stage3_max_live_parameters,
        z.stage3_max_reuse_distance,
        z.stage3_prefetch_bucket_size,
    ) == (2, 200_000_000, 1000, 3 * 10**8, 2 * 10**8, 10**7)
    # flags still win over the DeepSpeed file
    cfg = load_config(["--deepspeed_config", ds, "--lr", "2e-3"])
    assert cfg.optimizer.lr == 2e-3
    (tmp_path / "persist").mkdir()
    persist = write_json(
        tmp_path / "persist",
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5},
        },
    )
    z = validate_config(load_config(["--config", base_yaml, "--deepspeed_config", persist]), world_size=1).zero
    assert (z.stage, z.stage3_param_persistence_threshold) == (3, 100_000)


def test_bad_deepspeed_keys_rejected(tmp_path):
    cases = [
        ({"zero_optimizaton": {}}, r"unknown key 'zero_optimizaton' \(did you mean 'zero_optimization'\?\)"),
        (
            {"zero_optimization": {"reduce_bucketsize": 1}},
            r"zero_optimization: unknown key 'reduce_bucketsize' \(did you mean 'reduce_bucket_size'\?\)",
        ),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, r"offload_optimizer = .*not implemented yet"),
        ({"scheduler": {"type": "WarmupLR"}}, r"scheduler = .*not implemented yet"),
        ({"fp16": {"enabled": True, "hysteris": 2}}, r"unknown key 'hysteris' \(did you mean 'hysteresis'\?\)"),
        ({"data_types": {"grad_accum_dtype": "fp8"}}, r"grad_accum_dtype = 'fp8'"),
    ]
    for obj, message in cases:
        path = write_json(tmp_path, obj)
        with pytest.raises(ConfigError, match=message) as info:
            load_config(["--deepspeed_config", path])
        assert "ds.json" in str(info.value)


def test_not_implemented_features_refused_from_flags(base_yaml):
    assert "contiguous_gradients" in NOT_IMPLEMENTED_YET
    with pytest.raises(ConfigError, match=r"command line: zero\.contiguous_gradients = False: .*not implemented yet"):
        load_config(["--no-contiguous-gradients"])
    assert load_config(["--no-overlap-comm"]).zero.overlap_comm is False  # acts: no prefetch, reductions waited
    with pytest.raises(
        ConfigError,
        match=r"sequence_parallel = true needs "
        r"parallel\.tensor_model_parallel_size > 1",
    ):
        validate_config(load_config(["--config", base_yaml, "--sequence-parallel"]), 1)


def test_pretrain_checks_inputs_before_any_work(base_yaml, monkeypatch):
    import pretrain_gpt

    with pytest.raises(ConfigError, match=r"data\.data_path is empty"):
        pretrain_gpt.main(["--config", base_yaml])
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any process group is started
    with pytest.raises(
        ConfigError,
        match=r"world size 2 is not divisible by "
        r"tensor_model_parallel_size 4",
    ):
        pretrain_gpt.main(["--config", base_yaml, "--tensor-model-parallel-size", "4"])


def test_zeropp_keys_reach_the_engine_settings(base_yaml):
    z = validate_config(
        load_config(
            [
                "--config",
                base_yaml,
                "--zero-stage",  # qgZ needs gradients reduced per micro-batch (g in {I, G})
                "2",
                "--zero-quantized-gradients",
                "--qgz-block-size",
                "4096",
                "--qwz-block-size",
                "512",
                "--cpu-quant-kernels",
                "compiled",
            ]
        )
    ).zero
    settings = z.zeropp
    assert (settings.qgz, settings.qgz_block, settings.qwz_block, settings.cpu_kernels) == (True, 4096, 512, "compiled")
    assert settings.grads.block == 4096 and settings.alignment() == 4096
