"""What a new user reads in the first hour, run as they would: `pretrain_gpt.py`, `run.sh` and
the tools as subprocesses on real files, asserting the lines they print, the files they write
and their exit codes (issue 31's first-hour list: --help, the warmup of a short run, the
banner's start line and ZeRO lines, compare_runs' summary, the exports' file mode, negative
numbers as values, a zero split, a read-only dataset, a DeepSpeed JSON as CONFIG, and
Hugging Face's "auto" values)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support import TINY_MODEL_FLAGS
from test_analysis_compare import write_run

from megazpp.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
YAML = "configs/llama_tiny.yaml"  # run.sh's default CONFIG: warmup 30 of 300 steps
TINY = [
    *TINY_MODEL_FLAGS,
    "--global-batch-size",
    "4",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--split",
    "90,10,0",
]
# A DeepSpeed JSON as Hugging Face's integration writes it: "auto" wherever its trainer's
# arguments decide (here: --config and the flags), plus the ZeRO++ tutorial's switches.
HF_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "initial_scale_power": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
    },
}


def run(
    *argv: str, umask: int | None = None, env: dict[str, str] | None = None, wrap: list[str] | None = None
) -> subprocess.CompletedProcess:
    """A command from the repository root with this checkout first on the import path."""
    command = [*(wrap or []), *argv]
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def refusal(proc: subprocess.CompletedProcess) -> str:
    """Exit 2 and exactly one `pretrain_gpt.py: error:` line, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: "), lines
    return lines[0]


def read_only_wrapper(directory: Path) -> list[str] | None:
    """How to run a command that sees `directory` read-only: chmod for a user, a private
    read-only bind mount for root (whom permissions do not stop); None where neither works."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return []
    mount = ["sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(directory)]
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "--mount", *mount, "true"], capture_output=True).returncode != 0
    ):
        return None
    return ["unshare", "--mount", *mount]


# the tests of a real run (a subprocess training 10 steps, then the tools on its outputs) and of
# run.sh take well over 10 s on 2 loaded cores: the slow tier


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_indexed_prefix, tiny_tokenizer_model):
    """One short run as a user starts it: the YAML run.sh uses, a Hugging Face style DeepSpeed
    JSON over it, 10 steps, a dataset in a read-only directory, a fresh --save."""
    root = tmp_path_factory.mktemp("first_run")
    data = root / "data"
    data.mkdir()
    for suffix in (".bin", ".idx", ".tokenizer.json"):  # no index caches: they are built
        shutil.copy(f"{tiny_indexed_prefix}{suffix}", data / f"corpus_text_document{suffix}")
    shutil.copy(tiny_tokenizer_model, data / "tokenizer.model")
    (root / "hf_auto.json").write_text(json.dumps(HF_AUTO))
    wrap = read_only_wrapper(data)
    proc = run(
        sys.executable,
        "pretrain_gpt.py",
        "--config",
        YAML,
        "--deepspeed_config",
        str(root / "hf_auto.json"),
        "--data-path",
        str(data / "corpus_text_document"),
        "--tokenizer-model",
        str(data / "tokenizer.model"),
        *TINY,
        "--train-iters",
        "10",
        "--save",
        str(root / "ckpt"),
        "--tensorboard-dir",
        str(root / "tb"),
        wrap=wrap,
    )
    return root, data, wrap is not None, ok(proc), proc.stderr


@pytest.mark.slow
def test_help_shows_the_commands_defaults_and_run_sh_its_variables():
    builtin = ok(run(sys.executable, "pretrain_gpt.py", "--help"))
    assert "Defaults shown: the built-in values (no --config given)." in builtin
    assert re.search(r"--num-layers int +transformer layers \(default: 2\)\n", builtin)
    shown = ok(run("bash", "run.sh", "--help", env={"PYTHON": sys.executable, "NNODES": "3"}))
    # what run.sh runs: its CONFIG's values, the built-in ones beside them
    assert f"Defaults shown: config file {YAML} over the built-in values." in shown
    assert re.search(r"--num-layers int +transformer layers \(default: 4 from the config file; built-in 2\)", shown)
    assert re.search(r"--hidden-size int +model width \(default: 128 from the config file; built-in 64\)", shown)
    # every variable run.sh reads, with the value it has now
    script = (ROOT / "run.sh").read_text()
    variables = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?![A-Z0-9_\[])", script))
    assert {"CONFIG", "NPROC_PER_NODE", "NNODES", "MASTER_PORT", "DATA_DIR"} <= variables
    for name in variables:
        assert re.search(rf"^  .*\b{name}\b", shown, re.M), name
    assert re.search(r"^  NNODES +nodes of the job \(3\)$", shown, re.M)
    assert re.search(rf"^  CONFIG +the YAML config \({re.escape(YAML)}\)", shown, re.M)


def test_short_runs_warm_up_the_same_share_of_the_yaml_run(tiny_tokenizer_model):
    # the YAML warms up 30 of 300 steps; --train-iters 29 used to warm up 2, 30 all 30 (the
    # banner's line for one length: test_the_banner_of_a_first_run_says_each_thing_once_in_words)
    yaml = ["--config", YAML, "--tokenizer-model", str(tiny_tokenizer_model)]
    lengths = (9, 10, 29, 30, 31, 100, 299, 300, 400)
    warmups = [load_config([*yaml, "--train-iters", str(n)]).training.lr_warmup_iters for n in lengths]
    assert warmups == [0, 1, 2, 3, 3, 10, 29, 30, 30]  # never down as the run grows
    # a warmup given on the command line is the user's
    assert load_config([*yaml, "--train-iters", "30", "--lr-warmup-iters", "30"]).training.lr_warmup_iters == 30


@pytest.mark.slow
def test_the_banner_of_a_first_run_says_each_thing_once_in_words(first_run):
    root, _, _, out, err = first_run
    lines = out.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("model: ")))
    banner = lines[first : lines.index(next(line for line in lines if line.startswith("iter ")))]
    assert banner[0].startswith("model: llama, 2 layers, hidden 32"), banner
    assert all(line.startswith("data: cannot write") for line in lines[:first]), lines[:first]
    # "auto" took the flags' and the YAML's values
    assert "batch: global 4 = micro 2 x dp 1 x 2 accumulation; 10 steps, warmup 1, lr 0.002 cosine" in out
    assert (
        f"note: training.lr_warmup_iters = 30 (config file {YAML}) is for its 300 steps: using 1 "
        "for this run's 10, the same share (30/300)"
    ) in out
    # one start line, no second one contradicting it
    assert f"start: --save {root / 'ckpt'} holds no checkpoint yet: starting from scratch" in banner
    assert "no checkpoint to load" not in out and "no --load or --save" not in out
    # the engine's layout and ZeRO++ in the banner's words, once: no raw reprs, no warnings
    assert (
        "data-parallel optimizer: PaRO GGG (zero.stage 3); dp 1, PaRO group 1; G collectives in one "
        "stage; ZeRO++ off: one data-parallel rank, nothing crosses a link to compress (exact paths)"
    ) in banner
    assert "ZeroPP(" not in out + err and "Hierarchy(" not in out + err and "zero:" not in out + err
    assert "Warning" not in err, err


@pytest.mark.slow
def test_a_read_only_dataset_directory_is_one_line(first_run):
    root, data, read_only, out, err = first_run
    if not read_only:
        pytest.skip("no way to make a read-only directory here (root without unshare --mount)")
    said = [line for line in (out + err).splitlines() if str(data) in line and "cache" in line]
    assert said == [
        f"data: cannot write the dataset's index caches in {data} ("
        f"{'Read-only file system' if os.geteuid() == 0 else 'Permission denied'}): its indices "
        "(sample order, largest token id) are rebuilt at every start instead of loaded; training "
        "is unaffected"
    ], said
    assert "UserWarning" not in err and "iter     10/10 | saved checkpoint" in out
    assert not list(data.glob("*.npy"))


@pytest.mark.slow
def test_exports_have_the_mode_of_every_other_output(first_run):
    root = first_run[0]
    ok(
        run(
            sys.executable,
            "tools/export_checkpoint.py",
            "--load",
            str(root / "ckpt"),
            "--out",
            str(root / "model.safetensors"),
            umask=0o022,
        )
    )
    ok(
        run(
            sys.executable,
            "tools/convert_hf.py",
            "export",
            "--load",
            str(root / "ckpt"),
            "--hf-dir",
            str(root / "hf"),
            umask=0o027,
        )
    )

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(root / "model.safetensors") == 0o644  # was 0o600
    modes = {path.name: mode(path) for path in (root / "hf").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.model"} <= set(modes)
    assert set(modes.values()) == {0o640}, modes


@pytest.mark.slow
def test_compare_runs_shows_each_runs_own_final_loss_and_the_load_caveat(first_run, tmp_path):
    root = first_run[0]
    # beside the real 10-step run, a 300-step one (written as the trainer's logger writes it)
    write_run(
        tmp_path / "long",
        {
            "train/loss": {s: 6.0 - s / 100 for s in range(1, 301)},
            "perf/tokens_per_sec": {s: 1000.0 for s in range(1, 301)},
        },
    )
    out = ok(
        run(
            sys.executable,
            "tools/compare_runs.py",
            str(tmp_path / "long"),
            str(root / "tb"),
            "--out",
            str(tmp_path / "cmp"),
        )
    )
    assert "compared 2 run(s) on steps 1..10" in out
    summary = (tmp_path / "cmp" / "summary.md").read_text()
    assert (
        "The columns use the common training steps 1..10 (the steps every run logged), except the "
        "last two: each run's own last step and final train loss." in summary
    )
    assert summary.count("| own last step | own final train loss |") == 1
    long_row = next(line for line in summary.splitlines() if line.startswith("| long |"))
    assert long_row.endswith("| 300 | 3.0000 |") and "| 10 | 5.9000 |" in long_row, long_row
    assert "tokens/s depends on the machine's load" in summary
    # the plot says it too: in its title and as the PNG's caption (its Description text chunk)
    png = (tmp_path / "cmp" / "throughput.png").read_bytes()
    assert b"Description\x00tokens/s depends on the machine's load" in png


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--lr", "-1e-3"], "optimizer.lr (--lr) = -0.001: expected a learning rate > 0"),
        (["--split", "0,0,0"], "data.split = '0,0,0': the weights sum to zero"),
    ],
)
def test_bad_values_are_one_line_about_the_value(argv, expected, tiny_tokenizer_model):
    line = refusal(
        run(sys.executable, "pretrain_gpt.py", "--config", YAML, "--tokenizer-model", str(tiny_tokenizer_model), *argv)
    )
    assert expected in line and "expected one argument" not in line


@pytest.mark.slow
def test_a_deepspeed_json_as_config_and_its_keys_are_named_as_written(tmp_path, run_sh_data_dir):
    tutorial = "configs/deepspeed/zeropp_tutorial.json"
    line = refusal(
        run("bash", "run.sh", env={"CONFIG": tutorial, "PYTHON": sys.executable, "DATA_DIR": str(run_sh_data_dir)})
    )
    assert line == (
        f"pretrain_gpt.py: error: config file {tutorial}: this is a DeepSpeed config (its keys are "
        f"DeepSpeed's: zero_optimization), not a megazpp YAML: pass it as --deepspeed_config "
        f"{tutorial} (with run.sh: bash run.sh --deepspeed_config {tutorial}; CONFIG names the "
        "YAML it overrides)"
    )
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({**HF_AUTO, "train_batch_size": "sixteen"}))
    line = refusal(run(sys.executable, "pretrain_gpt.py", "--config", YAML, "--deepspeed_config", str(bad)))
    assert f"DeepSpeed config {bad}: train_batch_size = 'sixteen': expected an integer" in line
