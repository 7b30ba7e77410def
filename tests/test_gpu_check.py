"""tools/gpu_check.sh: its dry run on CPU (the plan, every engine job's flags valid), the
wheel option's refusals, and the parsers that read the tools' output on the GPU machine, fed
the output those tools print here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import load_tool

from benchmarks.gpu_check import elastic, pairs, provenance, two_level
from benchmarks.gpu_check.commands import Context, Outcome
from benchmarks.gpu_check.pairs import CPU, Side
from benchmarks.gpu_check.parse import bandwidth_rows, last_json, log_lines, planned_peak_gib
from benchmarks.gpu_check.settings import PLAN_FLAGS
from megazpp.checkpoint.format import checkpoint_name, rank_file_name

ROOT = Path(__file__).resolve().parents[1]


def _sh(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = python
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_the_plan_and_checks_the_engine_jobs():
    proc = _sh("--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = ["kernels-bitwise", "kernels-bandwidth", "data", "engine", "two-level", "elastic", "model-step"]
    steps += ["end-to-end"]
    steps += ["kernels-geometry", "zero3-compiled", "loop-overhead"]  # issue 40's
    for step in steps:
        assert f"  {step} " in proc.stdout
    for job in ("zero1", "zero3", "paro-IGG", "zeropp-loco"):
        assert f"engine job {job}: " in proc.stdout
    for name, ranks, flags in [*two_level.JOBS, two_level.NCCL_JOB]:
        assert f"two-level job {name}: {ranks} ranks, flags valid: {' '.join(flags)}" in proc.stdout
    assert "(over NCCL, one rank per GPU: only with 2 or more GPUs)" in proc.stdout
    assert f"elastic lighthouse: flags valid: {' '.join(elastic.LIGHTHOUSE)} --port 0" in proc.stdout
    for name, ranks, flags in elastic.jobs():
        assert f"elastic {name}: {ranks} ranks, flags valid: {' '.join(flags)}" in proc.stdout
    assert "zero3-compiled job: 2 ranks, flags valid:" in proc.stdout and proc.stdout.count("--compile") >= 2
    assert "source: " in proc.stdout and "source fingerprint " in proc.stdout
    # every path a GPU user can take runs first and fits the 8 minutes of device time the check has
    # (estimates; the report records the real times); the measurements after them run as the
    # budget allows
    paths = int(proc.stdout.split("first: ~")[1].split()[0])
    assert paths <= 470 and proc.stdout.index("  elastic ") < proc.stdout.index("  model-step ")


def test_missing_zstandard_and_torchft_need_carried_wheels(tmp_path):
    """As on the GPU machine: a Python without zstandard and torchft (here: without
    site-packages) stops the script with the way on, before anything runs; a --wheels path that
    is no directory is named."""
    bare = tmp_path / "python-without-site"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    proc = _sh("--out", str(tmp_path / "out"), python=str(bare))
    assert proc.returncode == 2 and "zstandard torchft not installed" in proc.stderr
    assert "carry their wheels and pass --wheels DIR" in proc.stderr
    proc = _sh("--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "absent"), python=str(bare))
    assert proc.returncode == 2 and f"--wheels {tmp_path / 'absent'} is not a directory" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_parsers_read_the_tools_output():
    quant = """| op | bytes moved | time (us) | GB/s | % of copy |
|---|---:|---:|---:|---:|
| quantize int8 (qwZ, bf16 in) | 196,736 | 67,976.2 | 0.0 | 64% |
| dequant-reduce int4 4 x 16384 -> int4 | 42,240 | 71,446.4 | 0.0 | 91% |"""
    assert bandwidth_rows(quant) == [
        ("quantize int8 (qwZ, bf16 in)", 0.64),
        ("dequant-reduce int4 4 x 16384 -> int4", 0.91),
    ]
    line = (
        "iter      5/30 | loss 7.6234 | lr 1.000e-04 | grad_norm 1.234 | tokens/s 41234 | tflops 412.3456 | "
        "peak_mem 36123.4 MiB | 0:00:10 elapsed, eta 0:00:50"
    )
    assert log_lines("noise\n" + line) == [{"iter": 5, "loss": 7.6234, "tokens_per_s": 41234.0, "peak_mib": 36123.4}]
    assert last_json('x\n{"a": 1}\nnot json\n{"tokens_per_s": 2.5}\n') == {"tokens_per_s": 2.5}


def test_planned_peak_from_the_planners_table():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plan = subprocess.run(
        [sys.executable, "tools/plan.py", *PLAN_FLAGS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    peak = planned_peak_gib(plan.stdout)
    assert 20 < peak < 60  # 1.1 B parameters in bf16 with fp32 masters and Adam, plus activations


def test_report_and_exit_status_follow_the_steps(tmp_path, monkeypatch):
    """Steps stubbed (no GPU here): a mismatch or a failing step gives exit 1, every step lands
    in OUT/report.md with its targets, and a step starts only with a minute (or its estimate)
    of the budget left."""
    import torch

    g = load_tool("gpu_check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a stub GPU")
    ok = g.Outcome("ok", "fine", ["detail"], [("a target", False, "80%")])
    steps = [
        ("first", "", 1, lambda ctx: ok),
        ("second", "", 1, lambda ctx: 1 / 0),
        ("third", "", 10_000, lambda ctx: ok),
    ]
    monkeypatch.setattr(g, "STEPS", steps)
    assert g.main(["--out", str(tmp_path), "--budget-s", "50"]) == 1
    report = (tmp_path / "report.md").read_text()
    assert "| first | ok | fine |" in report and "| a target | no | 80% |" in report
    assert "| second | FAILED | ZeroDivisionError: division by zero |" in report
    assert "| third | skipped |" in report
    monkeypatch.setattr(g, "STEPS", [steps[0], steps[2]])
    assert g.main(["--out", str(tmp_path), "--budget-s", "50"]) == 3  # only skipped: incomplete
    monkeypatch.setattr(g, "STEPS", [steps[0]])
    assert g.main(["--out", str(tmp_path), "--budget-s", "50"]) == 0  # a missed target is no failure


def test_tuned_geometry_rows_from_the_bandwidth_log(tmp_path):
    """kernels-geometry reads the autotuner's table bench_quant.py printed in kernels-bandwidth."""
    from benchmarks.gpu_check.commands import Context
    from benchmarks.gpu_check.overheads import geometry_rows, step_kernels_geometry

    log = (
        "| op | bytes moved | time (us) | GB/s | % of copy |\n|---|---:|---:|---:|---:|\n"
        "| quantize int8 (qwZ, bf16 in) | 1 | 2 | 3 | 80% |\n\n"
        "| kernel | constants | blocks | elements per program | warps |\n|---|---|---:|---:|---:|\n"
        "| _quantize_kernel | BITS=8 QMAX=127 | 131072 | 2048 | 2 |\n"
        "| _dequant_reduce_kernel | BITS=4 LOCO=False OUT_BITS=4 OUT_QMAX=7 PARTS=4 | 262144 | 8192 | 4 |\n"
    )
    assert [r[0] for r in geometry_rows(log)] == ["_quantize_kernel", "_dequant_reduce_kernel"]
    ctx = Context(tmp_path, 0.0, tmp_path)
    assert step_kernels_geometry(ctx).status == "FAILED"  # no log yet
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "kernels-bandwidth.log").write_text(log)
    outcome = step_kernels_geometry(ctx)
    assert outcome.status == "ok" and outcome.summary.startswith("2 kernel variants")
    assert "| _quantize_kernel | BITS=8 QMAX=127 | 131072 | 2048 | 2 |" in outcome.lines


CPU_B = Side("cpu-b", False, (), "CPU ranks again")


@pytest.mark.slow
def test_the_two_level_step_runs_on_cpu_ranks(tmp_path, run_sh_data_dir):
    """The step as the GPU machine runs it, every job and the comparison, with the GPU side
    replaced by a second set of CPU ranks (only the CUDA placement is left untried): each job
    trains to its end and the two sides' losses are equal (same device, same arithmetic)."""
    ctx = Context(tmp_path / "out", time.monotonic() + 3600, ROOT)
    ctx.out.mkdir()
    (ctx.out / "data").symlink_to(run_sh_data_dir)
    outcome = two_level.step_two_level(ctx, sides=(CPU, CPU_B), gpus=1)
    assert outcome.status == "ok", "\n".join(outcome.lines)
    rows = [line for line in outcome.lines if line.startswith("| ") and "ranks" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == [name for name, _, _ in two_level.JOBS]
    for row in rows:
        cells = row.split(" | ")
        assert cells[2] == cells[3] and len(cells[2].split(", ")) == 5 and cells[4] == "0.00e+00", row
    assert outcome.lines[-1] == "int4-nccl: skipped: NCCL needs one GPU per rank, and this machine has 1"
    assert outcome.summary == "3 jobs on CPU ranks vs CPU ranks again; NCCL job skipped (1 GPU)"


@pytest.mark.slow
def test_the_elastic_step_runs_on_cpu_ranks(tmp_path, run_sh_data_dir):
    """The elastic step as the GPU machine runs it (a lighthouse and two islands per side, both
    sides at once), the GPU side replaced by a second set of CPU ranks: every island meets the
    other at each of the three syncs and trains to its end, each island's losses are equal on
    the two sides (same device, same arithmetic), and on each side the islands' checkpoints at
    the last sync are equal bit for bit."""
    ctx = Context(tmp_path / "out", time.monotonic() + 3600, ROOT)
    ctx.out.mkdir()
    (ctx.out / "data").symlink_to(run_sh_data_dir)
    outcome = elastic.step_elastic(ctx, sides=(CPU, CPU_B))
    assert outcome.status == "ok", "\n".join(outcome.lines)
    assert outcome.summary == "2 elastic islands on CPU ranks vs CPU ranks again"
    rows = [line for line in outcome.lines if line.startswith("| island")]
    assert [row.split(" | ")[0][2:] for row in rows] == ["island0", "island1"]
    for row in rows:
        cells = row.split(" | ")
        assert cells[2] == cells[3] and len(cells[2].split(", ")) == elastic.ITERS and cells[4] == "0.00e+00", row
    for side in ("cpu", "cpu-b"):
        line = next(line for line in outcome.lines if line.startswith(f"{side}: the islands' checkpoints"))
        assert line.endswith("equal bit for bit"), line
    # islands 0 and 1 trained other samples (1/3 and 2/3 of the tokens): their losses differ
    assert rows[0].split(" | ")[2] != rows[1].split(" | ")[2]
    log = (ctx.out / "logs" / "elastic-island1-cpu.log").read_text()
    assert elastic.sync_lines(log, 1) == [(1, 2, "0,1"), (2, 4, "0,1"), (3, 6, "0,1")]


def test_the_elastic_islands_must_meet_at_every_sync_and_agree_bit_for_bit(tmp_path):
    """The elastic step's own judgement, on made-up logs and checkpoints: a sync one island met
    alone, or one ulp of one AdamW moment apart at the last sync, is a disagreement that names it."""
    ctx = Context(tmp_path, time.monotonic() + 60, ROOT)
    w = torch.linspace(-1, 1, 8)

    def save(island: int, moment: torch.Tensor) -> None:
        path = tmp_path / "ckpt" / f"elastic-island{island}-cpu" / checkpoint_name(elastic.ITERS)
        path.mkdir(parents=True)
        engine = {"optimizer": {"state": {0: {"step": 6, "exp_avg": moment, "exp_avg_sq": w * w}}}}
        torch.save({"model": {"w": w}, "engine": {**engine, "outer": {"snapshot": w}}}, path / rank_file_name(0, 0, 0))

    save(0, w)
    save(1, w)
    logs = {
        i: "".join(
            f"outer: island {i}, outer sync {s} at step {2 * s}: islands 0,1, tokens 1,2, weight 0.5\n"
            for s in (1, 2, 3)
        )
        for i in (0, 1)
    }
    assert elastic.islands_agree(ctx, "cpu", logs) == (
        True,
        ["cpu: the islands' checkpoints at the last sync (step 6), 4 tensors: equal bit for bit"],
    )
    alone = {**logs, 1: logs[1].replace("sync 2 at step 4: islands 0,1", "sync 2 at step 4: islands 1")}
    agree, lines = elastic.islands_agree(ctx, "cpu", alone)
    assert not agree and lines[0].startswith("island 1 on cpu: (sync, step, islands) [(1, 2, '0,1'), (2, 4, '1'),")
    shutil.rmtree(tmp_path / "ckpt" / "elastic-island1-cpu")
    save(1, torch.nextafter(w, w + 1))
    agree, lines = elastic.islands_agree(ctx, "cpu", logs)
    assert not agree and lines == [
        "cpu: the islands' checkpoints at the last sync (step 6), 4 tensors: differ in optimizer.0.exp_avg"
    ]


def test_the_nccl_job_runs_only_with_two_gpus(tmp_path, monkeypatch):
    """With 2 GPUs the NCCL job runs (NCCL ranks vs CPU ranks) and its verdict counts; with one
    it is skipped with a line. (The comparison is recorded here; the test above runs it.)"""
    calls = []

    def compare(ctx, prefix, common, jobs, bounds, sides):
        calls.append(([name for name, _, _ in jobs], [side.label for side in sides]))
        return Outcome("MISMATCH" if jobs == [two_level.NCCL_JOB] else "ok", f"{len(jobs)} jobs", ["| row |"])

    monkeypatch.setattr(two_level, "compare_on_sides", compare)
    ctx = Context(tmp_path, time.monotonic() + 60, ROOT)
    one = two_level.step_two_level(ctx, gpus=1)
    assert one.status == "ok" and one.summary == "3 jobs; NCCL job skipped (1 GPU)"
    assert calls == [(["zero2-int4", "zero3-stream", "zeropp-int4-stream"], ["cuda", "cpu"])]
    calls.clear()
    two = two_level.step_two_level(ctx, gpus=2)
    assert calls[1] == (["int4-nccl"], ["nccl", "cpu"]) and two.status == "MISMATCH"
    assert two.summary == "3 jobs; 1 jobs" and two.lines == ["| row |", "", "| row |"]


def test_every_two_level_job_has_the_quantized_bound():
    assert two_level.BOUND == dict.fromkeys(["zero2-int4", "zero3-stream", "zeropp-int4-stream", "int4-nccl"], 2e-2)
    assert pairs.relative_gap([2.0, 1.0], [2.0, 1.01]) == pytest.approx(0.01 / 1.01)
    assert pairs.relative_gap([1.0], [1.0, 2.0]) == float("inf")  # other steps logged


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_copied_tree_is_named_by_its_fingerprint_which_matches_its_commit(tmp_path):
    """The project committed in a repository of its own, then copied into a directory of
    another repository (as the device machine receives it): the copy names no commit (the
    surrounding one is not this project's) and its fingerprint is the commit's; a checkout at
    its own top level names its commit, and says when its files differ from it."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    project = tmp_path / "project"
    for rel, text in {
        "megazpp/a.py": "A = 1\n",
        "tools/b.sh": "echo b\n",
        "configs/c.yaml": "c: 1\n",
        "run.sh": "echo run\n",
        "docs/not_source.md": "prose\n",
        "megazpp/__pycache__/a.cpython-311.pyc": "bytes",
    }.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    subprocess.run([*git, "init", "-q"], cwd=project, check=True)
    subprocess.run([*git, "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=project, check=True)
    committed = provenance.fingerprint(provenance.commit_files(project, "HEAD"))
    assert committed == provenance.fingerprint(provenance.tree_files(project))
    assert provenance.describe(project).startswith("commit ")
    assert " with uncommitted changes" not in provenance.describe(project)

    outer = tmp_path / "outer"
    outer.mkdir()
    subprocess.run([*git, "init", "-q"], cwd=outer, check=True)
    copy = outer / "shared" / "tree"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "docs" / "not_source.md").write_text("other prose\n")  # not source: same fingerprint
    assert not provenance.git_top_level(copy)
    said = provenance.describe(copy)
    assert said.startswith(f"source fingerprint {committed[:16]} (the project root is no git checkout's top level")
    assert "commit " not in said.split("(")[0]

    (project / "megazpp" / "a.py").write_text("A = 2\n")
    provenance.describe.cache_clear()
    assert " with uncommitted changes" in provenance.describe(project)
    assert provenance.fingerprint(provenance.tree_files(project)) != committed
