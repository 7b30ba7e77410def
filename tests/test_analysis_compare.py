"""compare_runs on synthetic TensorBoard runs with known numbers: the table, the notes, the
PNGs, the closing line, and the errors for unusable run directories.

Values are multiples of 1/8 (exact in the float32 that event files store), so every number
in the table is asserted with ==.
"""

import struct
import time
from pathlib import Path

import pytest
import yaml
from support import load_tool
from torch.utils.tensorboard import SummaryWriter

from megazpp.analysis.compare_dirs import compare_directories
from megazpp.analysis.event_reader import read_run, read_runs
from megazpp.config.schema import Config
from megazpp.errors import ConfigError, DataError

MIB, GIB = 2**20, 2**30
STEPS = [10 * i for i in range(1, 11)]  # log interval 10, 100 iterations
SHORT = STEPS[:6]  # stopped at step 60

RUNS = {
    "ref": {
        "train/loss": dict(zip(STEPS, [4.0, 3.5, 3.0, 2.75, 2.5, 2.25, 2.125, 2.0, 1.875, 1.75])),
        "val/loss": {30: 3.125, 60: 2.375, 100: 1.625},
        "perf/tokens_per_sec": {s: 1000.0 + 10 * s for s in STEPS},
        "comm/inter_bytes": {s: 3.0 * MIB for s in STEPS},
        "mem/peak_bytes": {s: GIB + s // 10 * MIB for s in STEPS},
    },
    "short": {
        "train/loss": dict(zip(SHORT, [4.0, 3.75, 3.5, 3.25, 3.0, 3.125])),
        "val/loss": {30: 3.5, 60: 3.625},
        "perf/tokens_per_sec": dict(zip(SHORT, [400.0, 500.0, 600.0, 700.0, 800.0, 600.0])),
        "comm/inter_bytes": {s: s // 10 * MIB for s in SHORT},
        "mem/peak_bytes": {s: 512.0 * MIB for s in SHORT},
    },
    "nocomm": {
        "train/loss": dict(zip(STEPS, [4.5, 4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.25])),
        "val/loss": {30: 3.0, 60: 2.25, 100: 0.75},
        "perf/tokens_per_sec": {s: 2000.0 for s in STEPS},
        "mem/peak_bytes": {s: 3 * 512.0 * MIB for s in STEPS},
    },
}


def write_run(directory, scalars, config=None):
    """Write tags the way the trainer's logger does (SummaryWriter, config as YAML text)."""
    with SummaryWriter(log_dir=str(directory)) as writer:
        if config is not None:
            writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)
        for tag, points in scalars.items():
            for step, value in points.items():
                writer.add_scalar(tag, value, step)


def config_with(stage):
    cfg = Config().to_dict()
    cfg["zero"]["stage"] = stage
    return cfg


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # "short" keeps its events one level down, as a run dir with a tensorboard/ subdir would
    write_run(root / "ref", RUNS["ref"], config_with(0))
    write_run(root / "short" / "tensorboard", RUNS["short"], config_with(3))
    write_run(root / "nocomm", RUNS["nocomm"])
    return [root / "ref", root / "short", root / "nocomm"]


@pytest.fixture(scope="module")
def compared(run_dirs, tmp_path_factory):
    return compare_directories(run_dirs, tmp_path_factory.mktemp("out") / "cmp", smoothing=0.6)


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_numbers_over_the_common_steps(compared):
    rows = {row.label: row for row in compared.comparison.summaries}
    assert compared.comparison.step_range == (10, 60)
    ref, short, nocomm = rows["ref"], rows["short"], rows["nocomm"]
    assert (ref.final_step, ref.final_loss, ref.best_loss) == (60, 2.25, 2.25)
    assert (short.final_step, short.final_loss, short.best_loss) == (60, 3.125, 3.0)
    assert (nocomm.final_loss, nocomm.best_loss) == (2.0, 2.0)
    assert (ref.gap, short.gap, nocomm.gap) == (0.0, 0.875, -0.25)
    assert (ref.final_val_loss, ref.best_val_loss) == (2.375, 2.375)
    assert (short.final_val_loss, short.best_val_loss) == (3.625, 3.5)
    assert (ref.tokens_per_sec, short.tokens_per_sec, nocomm.tokens_per_sec) == (1350.0, 600.0, 2000.0)
    assert (ref.inter_bytes_per_step, short.inter_bytes_per_step) == (3 * MIB, 3.5 * MIB)
    assert nocomm.inter_bytes_per_step is None
    # the peak within steps 10..60, not the run's later, higher one
    assert (ref.peak_memory_bytes, short.peak_memory_bytes) == (GIB + 6 * MIB, 512 * MIB)


def test_summary_markdown_table_and_notes(compared):
    text = compared.summary_md.read_text()
    assert (
        "| ref | 60 | 2.2500 | 2.2500 | 2.3750 | 2.3750 | reference | 1,350.0 | 3.00 MiB | 1.01 GiB | 100 | 1.7500 |"
        in text
    )
    assert (
        "| short | 60 | 3.1250 | 3.0000 | 3.6250 | 3.5000 | +0.8750 | 600.0 | 3.50 MiB | 512.00 MiB | 60 | 3.1250 |"
        in text
    )
    assert (
        "| nocomm | 60 | 2.0000 | 2.0000 | 2.2500 | 2.2500 | -0.2500 | 2,000.0 | n/a | 1.50 GiB | 100 | 0.2500 |"
        in text
    )
    assert "gap to ref" in text and "The columns use the common training steps 10..60" in text
    assert "tokens/s depends on the machine's load" in text
    notes = [line for line in text.splitlines() if line.startswith("- ") and "**" not in line]
    assert any("differ in length" in n and "short: steps 10..60" in n and "ref: steps 10..100" in n for n in notes)
    assert "- run nocomm has no comm/inter_bytes" in notes
    assert len(notes) == 2
    assert "| zero.stage | `0` | `3` |" in text
    assert "No readable logged config for: nocomm." in text


def test_both_pngs_are_real_images(compared):
    for path in (compared.loss_png, compared.throughput_png):
        width, height = png_size(path)
        assert width > 200 and height > 200 and path.stat().st_size > 10_000
    assert not list(compared.loss_png.parent.glob(".*tmp*"))


def test_cli_closing_line_and_labels(run_dirs, tmp_path, capsys):
    tool = load_tool("compare_runs")
    out = tmp_path / "cli"
    assert tool.main([*map(str, run_dirs), "--out", str(out), "--labels", "A,B,C"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("compared 3 run(s) on steps 10..60: lowest final train loss C 2.0000; 2 note(s);")
    assert str(out / "summary.md") in line
    assert "| B | 60 | 3.1250 |" in (out / "summary.md").read_text()


def test_cli_error_names_the_empty_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    tool = load_tool("compare_runs")
    assert tool.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "compare_runs.py: error:" in err and str(tmp_path / "empty") in err
    assert "no TensorBoard event files" in err
    assert not (tmp_path / "out").exists()  # nothing written when a run is unusable


def test_missing_directory_is_a_data_error(run_dirs, tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'} does not exist"):
        compare_directories([run_dirs[0], tmp_path / "nope"], tmp_path / "out")


def test_two_event_directories_below_a_run_are_ambiguous(tmp_path):
    write_run(tmp_path / "run" / "x", {"train/loss": {1: 1.0}})
    write_run(tmp_path / "run" / "y", {"train/loss": {1: 1.0}})
    with pytest.raises(DataError, match="exactly one directory"):
        read_run(tmp_path / "run", "run")


def test_runs_without_shared_steps_are_refused(tmp_path):
    write_run(tmp_path / "early", {"train/loss": {1: 2.0, 2: 1.5}})
    write_run(tmp_path / "late", {"train/loss": {5: 1.0, 6: 0.5}})
    with pytest.raises(DataError, match=r"share no train/loss steps \(early: steps 1..2, late: steps 5..6\)"):
        compare_directories([tmp_path / "early", tmp_path / "late"], tmp_path / "out")


def test_bad_arguments_are_config_errors(run_dirs, tmp_path):
    with pytest.raises(ConfigError, match="--labels has 1 name"):
        compare_directories(run_dirs, tmp_path / "out", labels=["only"])
    with pytest.raises(ConfigError, match="smoothing weight 1.0 is outside"):
        compare_directories(run_dirs, tmp_path / "out", smoothing=1.0)
    assert not (tmp_path / "out").exists()


def test_resumed_run_reads_the_later_write(tmp_path):
    """A run resumed from step 2 rewrites steps 3 and 4 in a second event file."""
    write_run(tmp_path / "run", {"train/loss": {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0}})
    # event files are read in name order, and a name starts with its creation second then ends
    # with a per-process writer counter ("...9" sorts after "...10"): a resumed run is a new
    # process a second or more later, so the test waits like one
    time.sleep(1.05)
    write_run(tmp_path / "run", {"train/loss": {3: 2.5, 4: 2.25, 5: 2.0}})
    series = read_run(tmp_path / "run", "run").scalars["train/loss"]
    assert series.steps.tolist() == [1, 2, 3, 4, 5]
    assert series.values.tolist() == [4.0, 3.0, 2.5, 2.25, 2.0]


def test_notes_for_tags_missing_everywhere_or_outside_the_range(tmp_path):
    nan = float("nan")
    write_run(tmp_path / "x", {"train/loss": {1: 3.0, 2: nan, 3: 2.5, 4: 2.75}, "val/loss": {4: 2.5}})
    write_run(tmp_path / "y", {"train/loss": {1: 3.0, 2: 2.0, 3: 1.5}})
    result = compare_directories([tmp_path / "x", tmp_path / "y"], tmp_path / "out")
    notes = result.comparison.notes
    assert "runs x, y have no perf/tokens_per_sec" in notes
    assert "run y has no val/loss" in notes
    assert "run x has no val/loss point in steps 1..3" in notes
    x, y = result.comparison.summaries
    assert (x.final_loss, x.best_loss, x.final_val_loss) == (2.5, 2.5, None)  # NaN step skipped
    assert y.gap == -1.0
    assert "| x | 3 | 2.5000 | 2.5000 | n/a | n/a | reference | n/a | n/a | n/a |" in result.summary_md.read_text()


def logged(save, load=None, layers=2):
    cfg = Config().to_dict()
    cfg["model"]["num_layers"] = layers
    cfg["checkpoint"]["save"], cfg["checkpoint"]["load"] = save, load
    return cfg


def test_a_resumed_file_continues_only_the_run_it_resumed_from(tmp_path):
    """The README's comparison once showed the user's 300-step run cut at step 15 and continued
    by a test's step 16: the test's resumed run logged into the same directory. A resumed file
    joins the run whose checkpoints it loaded (its --load, or its --save when it resumed by
    itself), whichever run logged last."""
    run = tmp_path / "llama_tiny"
    write_run(run, {"train/loss": {1: 4.0, 10: 3.0, 20: 2.0, 30: 1.0}}, logged("checkpoints/llama_tiny", layers=4))
    time.sleep(1.05)  # a new process, a new event file name (test_resumed_run_reads_the_later_write)
    write_run(run, {"train/loss": {16: 5.0, 17: 4.5}}, logged("/tmp/test/ckpt", "/tmp/test/ckpt"))
    time.sleep(1.05)  # the user's own resume, explicit --load of a relative path spelled otherwise
    write_run(run, {"train/loss": {31: 0.75, 40: 0.5}}, logged("checkpoints/llama_tiny", "./checkpoints/llama_tiny/"))
    time.sleep(1.05)  # a torchrun restart of the user's run: no --load, resumed from its --save
    write_run(run, {"train/loss": {41: 0.25}}, logged("checkpoints/llama_tiny", layers=4))
    user, other = read_runs(run, "llama_tiny")
    assert (user.label, other.label) == ("llama_tiny#1", "llama_tiny#2")
    assert user.scalars["train/loss"].steps.tolist() == [1, 10, 20, 30, 31, 40, 41]
    assert other.scalars["train/loss"].steps.tolist() == [16, 17]
    # the same resumed file without the user's run beside it is a run of its own, not merged
    alone = tmp_path / "alone"
    write_run(alone, {"train/loss": {1: 4.0, 2: 3.0}}, logged("a"))
    time.sleep(1.05)
    write_run(alone, {"train/loss": {3: 2.0}}, logged("b", "b"))
    assert [r.scalars["train/loss"].steps.tolist() for r in read_runs(alone, "alone")] == [[1, 2], [3]]
