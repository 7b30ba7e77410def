"""The first hour of a new user, run as they would: `run.sh` and the tools as subprocesses on
real files (the tiny shared corpus stands in for data/). The README's quick start (a run, a
second run with other settings, a comparison, an export), DeepSpeed configs as users write them,
one-line refusals under run.sh, --help, Megatron aliases, and the tools' smaller promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import run_sh_variables

from megazpp.config.checks import check_config, validate_config
from megazpp.config.load import load_config
from megazpp.config.reference import DOC_PATH, render_markdown
from megazpp.config.schema import SECTIONS, flag_table
from megazpp.errors import ConfigError
from megazpp.setting import help_of, keys

ROOT = Path(__file__).resolve().parents[1]
# DeepSpeed JSON configs: the PaRO proposal's key (tests/data) and the ZeRO++ tutorial's block
PARO_JSON = ROOT / "tests" / "data" / "deepspeed" / "paro_nig.json"
TUTORIAL_JSON = ROOT / "configs" / "deepspeed" / "zeropp_tutorial.json"
# A model small enough for seconds per run; Megatron's spellings on purpose (aliases).
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--max-position-embeddings",
    "32",
    "--rotary-base",
    "10000",
    "--norm-epsilon",
    "1e-5",
    "--init-method-std",
    "0.02",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--eval-iters",
    "1",
    "--log-interval",
    "2",
    "--split",
    "90,10,0",
]


@pytest.fixture
def data_dir(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model) -> Path:
    """What run.sh expects under DATA_DIR, pointing at the session's tiny dataset."""
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "tokenizer.model").symlink_to(tiny_tokenizer_model)
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        (data / f"corpus_text_document{suffix}").symlink_to(f"{tiny_indexed_prefix}{suffix}")
    return data


def run_sh(data: Path, *args: str, nproc: int = 1, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **run_sh_variables(data, nproc, MAX_RESTARTS="0")}
    proc = subprocess.run(
        ["bash", str(ROOT / "run.sh"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def tool(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def one_line_refusal(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The refusal is exactly one `pretrain_gpt.py: error:` line, exit 2, no traceback and
    no rank ever started."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
def test_quick_start_run_second_run_compare_export(tmp_path, data_dir):
    ck, tb = tmp_path / "ckpt", tmp_path / "runs"
    first = run_sh(
        data_dir, *TINY, "--train-iters", "6", "--save", str(ck), "--tensorboard-dir", str(tb / "first")
    ).stdout
    # the banner, the warmup scaled from the YAML's 30 of 300 steps, saves, the clock
    for expected in (
        "model: llama, 2 layers, hidden 32",
        "layout: world 1 = tp 1 x pp 1 x dp 1",
        "data-parallel optimizer: none: one data-parallel replica",
        "train 24 samples, valid 4",
        f"checkpoints: {ck} every 100 steps",
        f"TensorBoard: {tb / 'first'}",
        "note: training.lr_warmup_iters = 30 (config file configs/llama_tiny.yaml) "
        "is for its 300 steps: using 0 for this run's 6",
        f"iter      6/6 | saved checkpoint {ck / 'iter_0000006'}",
        "| eta ",
    ):
        assert expected in first, expected
    assert "loss_scale" not in first and "skipped" not in first  # fp32: nothing to scale
    assert "\r" not in first
    saved = json.loads((ck / "iter_0000006" / "metadata.json").read_text())["config"]
    assert saved["model"]["seq_length"] == 32 and saved["model"]["rope_theta"] == 10000.0

    # a second run with other settings and the same --save: refused by name, nothing started
    again = [*TINY, "--train-iters", "8", "--micro-batch-size", "1", "--tensorboard-dir", str(tb / "first")]
    one_line_refusal(
        run_sh(data_dir, *again, "--save", str(ck), ok=False),
        f"--save {ck} already holds iter_0000006 of a run with other settings",
        "training.micro_batch_size 2 -> 1",
        "training.train_iters 6 -> 8",
        f"pass --load {ck} to continue it",
        "give another --save directory",
    )
    # ... continued on purpose with --load (the same settings resume by themselves:
    # test_reliability_checkpoint, and torchrun restarts: test_reliability_restart) ...
    resumed = run_sh(data_dir, *again, "--save", str(ck), "--load", str(ck)).stdout
    assert f"start: --load {ck}" in resumed
    assert f"resumed from {ck / 'iter_0000006'} at iteration 6" in resumed
    # ... or started fresh elsewhere (by pretrain_gpt.py itself), logging into the same
    # TensorBoard directory, which then holds two runs
    fresh = tool(
        "pretrain_gpt.py",
        "--config",
        "configs/llama_tiny.yaml",
        "--data-path",
        str(data_dir / "corpus_text_document"),
        "--tokenizer-model",
        str(data_dir / "tokenizer.model"),
        *again,
        "--save",
        str(tmp_path / "fresh"),
    ).stdout
    assert f"start: --save {tmp_path / 'fresh'} holds no checkpoint yet" in fresh

    # compare: the directory is split into its two runs (the resumed attempt continues the
    # first); 8 points each, so no smoothing by default
    cmp = tool("tools/compare_runs.py", str(tb / "first"), "--out", str(tmp_path / "cmp")).stdout
    assert "compared 2 run(s) on steps 1..8" in cmp and "smoothing 0;" in cmp
    summary = (tmp_path / "cmp" / "summary.md").read_text()
    assert f"{tb / 'first'} holds 2 runs with different configs" in summary
    assert "compared separately as first#1, first#2" in summary
    assert (tmp_path / "cmp" / "loss.png").stat().st_size > 0

    # export with no --config: the checkpoint knows its model and its tokenizer
    out = tool("tools/export_checkpoint.py", "--load", str(ck), "--out", str(tmp_path / "model.safetensors")).stdout
    assert f"wrote {tmp_path / 'model.safetensors'}" in out
    hf = tool("tools/convert_hf.py", "export", "--load", str(ck), "--hf-dir", str(tmp_path / "hf")).stdout
    assert "(with " in hf and (tmp_path / "hf" / "tokenizer.model").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 32
    # one overwrite rule: neither export replaces what is there
    for argv, what in (
        (
            ["tools/export_checkpoint.py", "--load", str(ck), "--out", str(tmp_path / "model.safetensors")],
            "already exists",
        ),
        (
            ["tools/convert_hf.py", "export", "--load", str(ck), "--hf-dir", str(tmp_path / "hf")],
            "config.json: already exists (a model)",
        ),
    ):
        refused = tool(*argv, ok=False)
        assert refused.returncode == 2 and what in refused.stderr
        assert "outputs are never overwritten" in refused.stderr
    # import at a longer sequence than the model was trained on: accepted, with a note
    imported = tool(
        "tools/convert_hf.py",
        "import",
        "--hf-dir",
        str(tmp_path / "hf"),
        "--save",
        str(tmp_path / "imported"),
        "--seq-length",
        "100000",
    ).stdout
    assert "note: --seq-length 100000 exceeds the model's max_position_embeddings 32" in imported


@pytest.mark.slow
def test_paro_json_config_runs_under_run_sh_and_refusals_are_one_line_per_job(tmp_path, data_dir):
    # DeepSpeed JSON naming a PaRO strategy, on 2 ranks: the banner names the strategy and its source
    out = run_sh(
        data_dir,
        *TINY,
        "--train-iters",
        "2",
        "--deepspeed_config",
        str(PARO_JSON),
        "--save",
        str(tmp_path / "ckpt"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        nproc=2,
    ).stdout
    assert "layout: world 2 = tp 1 x pp 1 x dp 2" in out
    assert "data-parallel optimizer: PaRO NIG (zero.paro_strategy NIG)" in out
    # refused inputs on 2 ranks: one line for the job (own directories: never the checkout's)
    own = ["--save", str(tmp_path / "ckpt2"), "--tensorboard-dir", str(tmp_path / "tb2")]
    # (an unknown flag, a cross-field ZeRO rule, the model's split; the quick start adds the resume
    # rule; the other refusals share the same path and are tested in process)
    one_line_refusal(
        run_sh(data_dir, *TINY, *own, "--rotary-bse", "3", nproc=2, ok=False),
        "unknown flag --rotary-bse (did you mean '--rotary-base'?)",
    )
    one_line_refusal(
        run_sh(data_dir, *TINY, *own, "--zero-stage", "3", "--paro-strategy", "NIG", nproc=2, ok=False),
        "zero.paro_strategy = 'NIG' and zero.stage = 3 disagree",
    )
    one_line_refusal(
        run_sh(data_dir, *TINY, *own, "--num-layers", "3", "--pipeline-model-parallel-size", "2", nproc=2, ok=False),
        "model num_layers = 3 is not divisible by pipeline_model_parallel_size",
    )
    # --help through run.sh and directly
    assert "Megatron-LM spellings" in run_sh(data_dir, "--help").stdout


def test_deepspeed_configs_are_accepted_as_written(tmp_path):
    # the PaRO proposal's key and the ZeRO++ tutorial's block, as their authors write them
    strategies = {
        path.name: check_config(load_config(["--deepspeed_config", str(path)]), 4).zero.resolved.name
        for path in (PARO_JSON, TUTORIAL_JSON)
    }
    assert strategies == {"paro_nig.json": "NIG", "zeropp_tutorial.json": "GGG"}
    # the granularity key under both its draft name in DeepSpeed's PR
    # (stage3_coalesced_fetch_threshold) and its merged one
    for key in ("stage3_coalesced_fetch_threshold", "stage3_module_granularity_threshold"):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3, key: 12000}}))
        assert load_config(["--deepspeed_config", str(path)]).zero.module_granularity_threshold == 12000
    # every PaRO strategy, and auto, from the JSON key; a non-strategy refused by name
    for name in (
        "NNN",
        "NNI",
        "NNG",
        "NII",
        "NIG",
        "NGG",
        "INI",
        "ING",
        "III",
        "IIG",
        "IGG",
        "GNG",
        "GIG",
        "GGG",
        "auto",
    ):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"zero_optimization": {"paro_strategy": name}}))
        assert validate_config(load_config(["--deepspeed_config", str(path)]), 4).zero.paro_strategy == name
    path.write_text(json.dumps({"zero_optimization": {"paro_strategy": "GNN"}}))
    with pytest.raises(ConfigError, match="zero.paro_strategy='GNN': optimizer state must be"):
        validate_config(load_config(["--deepspeed_config", str(path)]), 4)


def test_help_and_flag_reference_follow_the_schema():
    # one line of help beside every key, in the section's own class
    missing = [
        f"{s}.{n}" for s, n in flag_table().values() if not help_of(next(f for f in keys(SECTIONS[s]) if f.name == n))
    ]
    assert not missing, missing
    assert DOC_PATH.read_text() == render_markdown(), "docs/flags.md is stale: run python -m megazpp.config.reference"
    out = tool("pretrain_gpt.py", "--help").stdout
    assert "--micro-batch-size int" in out and "(default: 4)" in out
    assert "--rotary-base                      = --rope-theta" in out


def test_megatron_aliases_and_refusals():
    cfg = validate_config(
        load_config(
            [
                "--max-position-embeddings",
                "256",
                "--init-method-std",
                "0.01",
                "--norm-epsilon=1e-6",
                "--rotary-base",
                "500000",
                "--recompute-activations",
                "--use-distributed-optimizer",
                "--lr-warmup-fraction",
                "0.1",
                "--train-iters",
                "50",
            ]
        )
    )
    m = cfg.model
    assert (m.seq_length, m.init_std, m.norm_eps, m.rope_theta, m.activation_checkpointing) == (
        256,
        0.01,
        1e-6,
        500000.0,
        True,
    )
    assert cfg.zero.stage == 1 and cfg.training.lr_warmup_iters == 5
    for argv, message in (
        (
            ["--seq-length", "128", "--max-position-embeddings", "1024"],
            "--seq-length 128 and --max-position-embeddings 1024 both set --seq-length",
        ),
        (["--zero-stage", "3", "--use-distributed-optimizer"], "both set --zero-stage"),
        (["--distributed-backend", "mpi"], "parallel.distributed_backend"),
        (["--no-load-optim"], "--no-load-optim: not implemented"),
        (["--rotary-bse", "3"], "unknown flag --rotary-bse (did you mean '--rotary-base'?)"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "give one"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_config(load_config(argv))


def test_data_tools_print_no_carriage_returns_and_tokenizer_says_what_it_trained(tmp_path):
    corpus = tool("tools/make_sample_corpus.py", "--out", str(tmp_path / "corpus"), "--total-bytes", "60000")
    tok = tool(
        "tools/train_tokenizer.py",
        "--input",
        str(tmp_path / "corpus"),
        "--vocab-size",
        "50000",
        "--out",
        str(tmp_path / "tok"),
    )
    trained = re.search(r"vocab (\d+) trained", tok.stdout)
    assert trained and int(trained[1]) < 50000
    assert (
        f"note: --vocab-size 50000 asked for more pieces than this corpus yields: trained {trained[1]}"
    ) in tok.stdout
    assert "SentencePiece is sampling them and learning the BPE merges" in tok.stdout
    prep = tool(
        "tools/preprocess_data.py",
        "--input",
        str(tmp_path / "corpus"),
        "--tokenizer-model",
        str(tmp_path / "tok.model"),
        "--output-prefix",
        str(tmp_path / "c"),
    )
    for proc in (corpus, tok, prep):
        assert "\r" not in proc.stdout + proc.stderr


def test_banner_says_why_auto_picked_its_strategy(tiny_indexed_prefix, tiny_tokenizer_model, capsys):
    import pretrain_gpt

    pretrain_gpt.main(
        [
            "--data-path",
            str(tiny_indexed_prefix),
            "--tokenizer-model",
            str(tiny_tokenizer_model),
            *TINY,
            "--train-iters",
            "1",
            "--eval-iters",
            "0",
            "--paro-strategy",
            "auto",
            "--accelerator-memory-gib",
            "8",
            "--achievable-tflops",
            "1",
        ]
    )
    out = capsys.readouterr().out
    chosen = re.search(r"zero: paro_strategy auto -> (\w{3}) \(runner-up \w+\): \1 fits", out)
    assert chosen, out
    assert (
        f"data-parallel optimizer: PaRO {chosen[1]} (zero.paro_strategy auto: the planner's choice, reason above)"
    ) in out
