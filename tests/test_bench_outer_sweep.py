"""The two-level quality sweep's report (benchmarks.outer_sweep) on synthetic TensorBoard
runs, and the experiment script's runs resolve to the settings it names. No training here:
`tools/run_outer_experiment.sh --smoke` is the end-to-end check."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from benchmarks.outer_sweep import main as sweep_main
from megazpp.config.checks import resolve_outer, validate_config
from megazpp.config.load import load_config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "run_outer_experiment.sh"


def _write(
    directory: Path, train: list[float], val: float, inter: float, done: bool = True, config: str | None = None
) -> None:
    writer = SummaryWriter(str(directory))
    if config is not None:  # as the trainer logs it (megazpp.training.logger.write_config)
        writer.add_text("config", "```yaml\n" + config + "```", 0)
    for step, value in enumerate(train, start=1):
        writer.add_scalar("train/loss", value, step * 10)
        writer.add_scalar("comm/inter_bytes", inter * (2, 0, 1)[(step - 1) % 3], step * 10)  # mean: inter
    writer.add_scalar("val/loss", val, 10 * len(train))
    writer.close()
    if done:
        (directory / "DONE").touch()


def test_table_gaps_and_verdicts_from_runs(tmp_path, capsys):
    sync = "zero:\n  stage: 2\nouter:\n  algorithm: none\n"
    h10 = (
        "zero:\n  stage: 2\nouter:\n  algorithm: diloco\n  sync_every: 10\n  lr: 1.0\n  momentum: 0.0\n"
        "  quantize: int4\n  error_feedback: false\n"
    )
    for seed, base in ((1, 4.0), (2, 4.2)):
        _write(tmp_path / f"seed{seed}" / "sync", [6.0, 5.0, 4.5], base, 4e6, config=sync)
        _write(tmp_path / f"seed{seed}" / "h10", [6.0, 5.0, 4.6], base + 0.04, 2e5, config=h10)
        _write(tmp_path / f"seed{seed}" / "h25", [6.0, 5.0, 4.7], base + 0.10, 8e4)
    _write(tmp_path / "seed3" / "h25", [6.0, 5.0, 4.7], 9.0, 8e4)  # no sync of seed 3: no pair
    _write(tmp_path / "seed1" / "h50", [6.0], 9.0, 1e3, done=False)  # unfinished: left out
    out = tmp_path / "sweep.md"
    assert (
        sweep_main([str(tmp_path), "--train-window", "20", "--out", str(out), "--plot", str(tmp_path / "sweep.png")])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    sync = rows["| synchronous ZeRO-2"]  # described by the logged config
    assert "| 1,2 | 4.5000 +- 0.0000 [4.5000, 4.5000] | 4.7500 +- 0.0000" in sync  # window: steps 20-30
    assert "4.1000 +- 0.1414 [4.0000, 4.2000] | reference | 4.000 |" in sync
    assert "| +0.0400 | 0.200 |" in rows["| H = 10, int4, no error feedback, outer lr 1 momentum 0"]
    assert "| 1,2,3 |" in rows["| h25"] and "| +0.1000 |" in rows["| h25"]  # no config logged: its name
    assert not any("h50" in line for line in lines)
    verdicts = [line for line in lines if "mean val gap" in line]
    assert verdicts[0] == (
        "H = 10, int4, no error feedback, outer lr 1 momentum 0: mean val gap +0.0400 over "
        "seeds 1,2 (meets the <= 0.05 target; fewer than 3 seeds)"
    )
    assert verdicts[1].startswith("h25: mean val gap +0.1000 over seeds 1,2 (misses")
    assert out.read_text().startswith("# Two-level quality sweep")
    assert (tmp_path / "sweep.png").stat().st_size and (tmp_path / "sweep_curves.png").stat().st_size


def test_refuses_a_directory_without_the_reference(tmp_path, capsys):
    assert sweep_main([str(tmp_path)]) == 2
    assert "no finished 'sync' run" in capsys.readouterr().err


def test_the_scripts_runs_resolve_to_what_they_name(tiny_tokenizer_model):
    text = SCRIPT.read_text()
    base = re.search(r"^BASE=(\S+)", text, re.M).group(1)
    two_level = re.search(r'^TWO_LEVEL="([^"]+)"', text, re.M).group(1).split()
    runs = dict(re.findall(r'^  \[(\w+)\]="([^"]*)"', text, re.M))
    assert set(runs) == {
        "sync",
        "h1",
        "h5",
        "h10",
        "h25",
        "h50",
        "h25_int4",
        "h25_int4_noef",
        "h1_diloco",
        "h10_diloco",
        "h25_diloco",
    }
    for name, flags in runs.items():
        argv = ["--config", str(REPO / base), "--tokenizer-model", str(tiny_tokenizer_model)]
        argv += [] if name == "sync" else two_level + flags.split()
        cfg = validate_config(load_config(argv), 4)
        outer = resolve_outer(cfg, 4, cfg.parallel.ranks_per_node)
        assert cfg.zero.stage == 2 and cfg.training.train_iters == 600
        if name == "sync":
            assert outer is None
            continue
        assert outer.sync_every == int(re.match(r"h(\d+)", name).group(1))
        assert outer.quantize == ("int4" if "int4" in name else "bf16")
        assert outer.error_feedback == (not name.endswith("noef"))
        diloco = name.endswith("_diloco")  # DiLoCo's outer optimizer; the sweep's is plain averaging
        assert (outer.lr, outer.momentum) == ((0.7, 0.9) if diloco else (1.0, 0.0))


def test_script_refuses_unknown_arguments():
    run = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert run.returncode == 2 and "usage:" in run.stderr
