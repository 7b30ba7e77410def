"""The LoCo experiment's configs (three runs that differ only in gradient reduction), the
gap-closure arithmetic, and the script's refusal of unknown arguments. No training here:
`tools/run_loco_experiment.sh --smoke` is the end-to-end check."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from benchmarks.loco_gap import closed_fraction, describe
from benchmarks.loco_gap import main as loco_gap_main
from megazpp.config.checks import validate_config
from megazpp.config.load import load_config

REPO = Path(__file__).resolve().parents[1]
LOCO = REPO / "configs" / "experiments" / "loco"
RUNS = ("fp32", "qgz_int4", "qgz_int4_loco")


def _flat(cfg) -> dict:
    return {f"{section}.{key}": value for section, fields in cfg.to_dict().items() for key, value in fields.items()}


def test_the_three_runs_differ_only_in_gradient_reduction(tiny_tokenizer_model):
    # The configs name data/tokenizer.model, which only run.sh builds: a clean checkout has none.
    tokenizer = ["--tokenizer-model", str(tiny_tokenizer_model)]
    cfgs = {run: load_config(["--config", str(LOCO / f"{run}.yaml"), *tokenizer]) for run in RUNS}
    for cfg in cfgs.values():
        validate_config(cfg, 4)
        assert cfg.parallel.ranks_per_node == 2  # 4 ranks = 2 virtual nodes x 2: both qgZ stages
        assert cfg.zero.stage == 2
    base = _flat(cfgs["fp32"])
    for run in RUNS[1:]:
        other = _flat(cfgs[run])
        differing = {k for k in base if base[k] != other[k]}
        assert differing <= {
            "logging.tensorboard_dir",
            "zero.zero_quantized_gradients",
            "zero.loco",
            "zero.qgz_block_size",
            "zero.loco_reset_t",
        }
        assert cfgs[run].zero.qgz_block_size == 2048  # coarse enough that int4 visibly hurts
    assert not cfgs["fp32"].zero.zero_quantized_gradients
    assert cfgs["qgz_int4"].zero.zero_quantized_gradients and not cfgs["qgz_int4"].zero.loco
    loco = cfgs["qgz_int4_loco"].zero
    assert loco.zero_quantized_gradients and loco.loco
    assert (loco.loco_err_beta, loco.loco_reset_t) == (0.8, 200)
    assert loco.loco_reset_t < cfgs["qgz_int4_loco"].training.train_iters  # the periodic reset fires
    assert [cfgs[r].logging.tensorboard_dir for r in RUNS] == [f"runs/loco/{r}" for r in RUNS]


def test_gap_closed():
    assert closed_fraction(3.0, 3.2, 3.05) == pytest.approx(0.75)
    assert closed_fraction(3.0, 3.2, 3.3) == pytest.approx(-0.5)  # LoCo worse than int4
    assert closed_fraction(3.0, 2.9, 2.95) is None  # int4 not worse: nothing to close
    assert describe("val", 3.0, 3.2, 3.05).endswith("LoCo closes 75% of the gap (meets the >= 50% target)")
    assert "misses" in describe("val", 3.0, 3.2, 3.15)
    assert "no gap to close" in describe("val", 3.0, 3.0, 3.1)
    assert describe("val", 3.0, None, 3.1) == "val: n/a (a run lacks this loss)"


def test_gap_report_from_runs(tmp_path, capsys):
    finals = {"fp32": 4.0, "int4": 4.4, "loco": 4.1}
    for name, final in finals.items():
        writer = SummaryWriter(str(tmp_path / name))
        for step, value in ((10, 6.0), (20, final)):
            writer.add_scalar("train/loss", value, step)
        writer.add_scalar("val/loss", final + 0.5, 20)
        writer.close()
    out = tmp_path / "gap.md"
    assert loco_gap_main([str(tmp_path / n) for n in finals] + ["--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("final train loss: fp32 4.0000, int4 4.4000, int4+LoCo 4.1000")
    assert "LoCo closes 75% of the gap" in lines[0] and "LoCo closes 75% of the gap" in lines[1]
    assert out.read_text().startswith("# LoCo experiment: gap closed")
    assert loco_gap_main([str(tmp_path / "missing")] * 3) == 2


def test_gap_report_over_seeds(tmp_path, capsys):
    """Each run given as one directory per seed: means decide, spreads and per-seed closures listed."""
    finals = {"fp32": (4.0, 4.2), "int4": (4.4, 4.4), "loco": (4.1, 4.3)}
    dirs = {}
    for name, per_seed in finals.items():
        for seed, final in enumerate(per_seed):
            writer = SummaryWriter(str(tmp_path / f"s{seed}" / name))
            for step, value in ((10, 6.0), (20, final)):
                writer.add_scalar("train/loss", value, step)
            writer.add_scalar("val/loss", final + 0.5, 20)
            writer.close()
        dirs[name] = ",".join(str(tmp_path / f"s{seed}" / name) for seed in range(len(per_seed)))
    png = tmp_path / "seeds.png"
    assert loco_gap_main([dirs["fp32"], dirs["int4"], dirs["loco"], "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    # means: fp32 4.1, int4 4.4, LoCo 4.2 -> closes 2/3 of the gap
    assert lines[0].startswith("final train loss (mean of 2 seeds): fp32 4.1000, int4 4.4000, int4+LoCo 4.2000")
    assert "LoCo closes 67% of the gap" in lines[0]
    assert lines[2].startswith("fp32: final train loss 4.1000 +- 0.1414 [4.0000, 4.2000]")
    assert lines[5] == "per seed, LoCo closes of the train gap: 75%, 50%"
    assert loco_gap_main([dirs["fp32"], dirs["int4"], str(tmp_path / "s0" / "loco")]) == 2  # seeds differ


def test_train_window_estimate_beside_the_last_interval(tmp_path, capsys):
    """--train-window 10: the mean of the points logged over the last 10 steps (15 and 20, not
    10), as a third verdict line; the last-interval lines stay as they were."""
    series = {"fp32": (6.0, 4.0, 4.2), "int4": (6.0, 4.6, 4.4), "loco": (6.0, 4.1, 4.3)}
    for name, values in series.items():
        writer = SummaryWriter(str(tmp_path / name))
        for step, value in zip((10, 15, 20), values):
            writer.add_scalar("train/loss", value, step)
        writer.close()
    dirs = [str(tmp_path / n) for n in series]
    assert loco_gap_main(dirs + ["--train-window", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("final train loss: fp32 4.2000, int4 4.4000, int4+LoCo 4.3000")
    assert lines[2].startswith("train loss over the last 10 steps: fp32 4.1000, int4 4.5000, int4+LoCo 4.2000")
    assert "LoCo closes 75% of the gap" in lines[2]
    with pytest.raises(SystemExit):
        loco_gap_main(dirs + ["--train-window", "0"])


def test_script_refuses_unknown_arguments():
    done = subprocess.run(
        ["bash", str(REPO / "tools" / "run_loco_experiment.sh"), "--full"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "usage" in done.stderr
