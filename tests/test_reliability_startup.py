"""What `run.sh`'s once-per-job check refuses before any rank starts, tried as a user would
(`run.sh` / `pretrain_gpt.py` subprocesses, real files, real processes): a `--load` that
cannot start this run (another tp / pp, model or engine), a `--tensorboard-dir` or `--save`
naming a file, garbage node variables, a run that would not fit in memory, and a second job
on one `--save`; and what it adapts instead of refusing (hpZ on nodes of one rank)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_first_hour import ROOT, TINY, one_line_refusal, run_sh
from test_reliability_inputs import pretrain, refused
from test_training_pretrain import tiny_args

import pretrain_gpt
from megazpp.checkpoint import lock as save_lock
from megazpp.errors import CheckpointError
from megazpp.training.startup import prepare

_AT = TINY.index("--max-position-embeddings")
TINY_ANY_LENGTH = TINY[:_AT] + TINY[_AT + 2 :]  # TINY without its sequence length


def tree_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def job_args(data: Path, *extra: str) -> list[str]:
    """pretrain_gpt.py's arguments as `run.sh *TINY *extra` passes them with DATA_DIR=data."""
    return [
        "--config",
        str(ROOT / "configs/llama_tiny.yaml"),
        "--data-path",
        str(data / "corpus_text_document"),
        "--tokenizer-model",
        str(data / "tokenizer.model"),
        *TINY,
        *extra,
    ]


@pytest.fixture
def saved_run(tmp_path, run_sh_data_dir) -> Path:
    """A 2-step run of TINY on one rank (LocalEngine), saved; its files hashed by the tests."""
    ckpt = tmp_path / "ckpt"
    pretrain_gpt.main(
        job_args(run_sh_data_dir, "--train-iters", "2", "--save", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb"))
    )
    return ckpt


@pytest.mark.slow
def test_a_load_that_cannot_start_this_run_is_one_line_before_any_rank(tmp_path, run_sh_data_dir, saved_run):
    before = tree_hashes(saved_run)
    new = tmp_path / "new"
    own = [
        "--train-iters",
        "4",
        "--load",
        str(saved_run),
        "--save",
        str(new),
        "--tensorboard-dir",
        str(tmp_path / "tb2"),
    ]
    # on 2 ranks under run.sh: one line for the job
    # another tp: used to be one error per rank suggesting --load-fallback (which cannot help)
    line = one_line_refusal(
        run_sh(run_sh_data_dir, *TINY, *own, "--tensor-model-parallel-size", "2", nproc=2, ok=False),
        "iter_0000002 was saved under tensor-parallel size 1, pipeline size 1; this run has 2 and 1",
        "--tensor-model-parallel-size 1",
        f"tools/convert_hf.py export --load {saved_run} --hf-dir HF",
    )
    assert "--load-fallback" not in line
    # another engine: used to be "cannot reshard: ... holds no ZeRO engine state", per rank
    one_line_refusal(
        run_sh(run_sh_data_dir, *TINY, *own, nproc=2, ok=False),
        "saved by the single-replica engine",
        "this run uses the ZeRO engine over 2",
        "resharding converts only between ZeRO layouts",
        "resume it with 1 rank(s) and its zero settings (stage 0, paro_strategy None)",
    )

    # the same check (startup.prepare, which run.sh's check and every rank run), in process
    def refusal(world_size: int, *extra: str) -> str:
        with pytest.raises(CheckpointError) as caught:
            prepare(job_args(run_sh_data_dir, *own, *extra), world_size)
        return str(caught.value)

    assert "pipeline size 1; this run has 1 and 2" in refusal(2, "--pipeline-model-parallel-size", "2")
    # another width: used to be torch's `Error(s) in loading state_dict` with the key list
    line = refusal(1, "--hidden-size", "64")
    assert "iter_0000002 holds another model (model.hidden_size 32 -> 64" in line
    assert f"{saved_run}/iter_0000002/metadata.json" in line and "state_dict" not in line
    assert "model.arch llama -> gpt2" in refusal(1, "--arch", "gpt2")
    assert "this run uses the ZeRO engine over 1" in refusal(1, "--zero-stage", "1")
    # another precision: LocalEngine's state has fp32 masters only under bf16 / fp16
    assert "iter_0000002 was saved in fp32; this run is in bf16, and its engine state" in refusal(1, "--bf16")
    assert tree_hashes(saved_run) == before and not new.exists()
    # what a --load may change still resumes (dropout: no tensor changes shape)
    out = pretrain(*job_args(run_sh_data_dir, *own, "--hidden-dropout", "0.1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"resumed from {saved_run}/iter_0000002 at iteration 2" in out.stdout


@pytest.mark.slow
def test_output_paths_naming_files_are_one_line_before_any_rank(
    tmp_path, run_sh_data_dir, tiny_indexed_prefix, tiny_tokenizer_model
):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    args = tiny_args(tiny_indexed_prefix, tiny_tokenizer_model, "--train-iters", "2")
    # a 49-line FileExistsError traceback from the TensorBoard writer, once per rank
    one_line_refusal(
        run_sh(run_sh_data_dir, *TINY, "--train-iters", "2", "--tensorboard-dir", str(notes), nproc=2, ok=False),
        f"--tensorboard-dir {notes} exists and is not a directory",
    )
    refused(pretrain(*args, "--tensorboard-dir", str(notes / "run1")))
    line = refused(pretrain(*args, "--save", str(notes / "ckpt")))
    assert line.endswith(
        f"--save {notes / 'ckpt'} lies under {notes}, which exists and is not a "
        "directory: give a directory (it is created when missing)"
    )
    assert notes.read_text() == "mine\n"


@pytest.mark.slow
def test_node_variables_are_one_line_from_run_sh(tmp_path, run_sh_data_dir):
    base = {**os.environ, "DATA_DIR": str(run_sh_data_dir), "PYTHON": sys.executable}
    cases = {  # before: a ZeroDivisionError traceback; bash's "unbound variable"
        (("NPROC_PER_NODE", "0"),): "NPROC_PER_NODE = '0': expected a whole number >= 1",
        (("NPROC_PER_NODE", "abc"),): "NPROC_PER_NODE = 'abc': expected a whole number >= 1",
        (("NNODES", "two"),): "NNODES = 'two': expected a whole number >= 1",
        (("NNODES", "2"), ("NODE_RANK", "2")): "NODE_RANK = 2: expected 0..1 (NNODES = 2)",
    }
    for env, expected in cases.items():
        proc = subprocess.run(
            ["bash", str(ROOT / "run.sh"), *TINY, "--save", str(tmp_path / "c")],
            env={**base, **dict(env)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"run.sh: error: {expected}"), lines
        assert "Traceback" not in proc.stderr and not (tmp_path / "c").exists()


@pytest.mark.slow
def test_hpz_on_nodes_of_one_rank_runs_with_hpz_off_said_once(tmp_path, run_sh_data_dir):
    # the ZeRO++ tutorial's block asks for hpZ over 16 ranks; each virtual node holds one: every
    # rank used to warn "using 1" and then fail asking to "set it to 1"
    save = tmp_path / "ckpt"
    proc = run_sh(
        run_sh_data_dir,
        *TINY,
        "--train-iters",
        "2",
        "--deepspeed_config",
        str(ROOT / "configs/deepspeed/zeropp_tutorial.json"),
        "--ranks-per-node",
        "1",
        "--save",
        str(save),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        nproc=2,
    )
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "zero_hpz_partition_size" in line]
    assert said == [
        "data-parallel optimizer: PaRO GGG (zero.stage 3) + qwZ, qgZ; dp 2, PaRO group 1; "
        "G collectives in one stage; zero_hpz_partition_size 16: hpZ off, a node holds one "
        "data-parallel rank (backward gathers the primary shards)"
    ], said
    # global rank 0 held --save's lock for the job and removed it at exit
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "latest"]


@pytest.mark.slow
def test_a_run_too_large_for_memory_is_refused_before_any_rank(
    tmp_path, run_sh_data_dir, tiny_indexed_prefix, tiny_tokenizer_model
):
    # --seq-length 1000000 used to grow to 24 GB until the OOM killer ended it
    line = one_line_refusal(
        run_sh(
            run_sh_data_dir,
            *TINY_ANY_LENGTH,
            "--seq-length",
            "1000000",
            "--save",
            str(tmp_path / "c"),
            nproc=2,
            ok=False,
        ),
        "this run needs about",
        "of memory per rank (planner estimate: ",
        "/ 2 ranks on this node): lower --seq-length (1000000)",
        "--skip-memory-check",
    )
    assert not (tmp_path / "c").exists()
    args = tiny_args(tiny_indexed_prefix, tiny_tokenizer_model, "--seq-length", "1000000")
    prepare([*args, "--skip-memory-check"], 1, ranks_on_node=1)  # the flag overrides it
    refused(pretrain(*args))  # pretrain_gpt.py alone checks it too
    assert "GiB" in line
    # not wildly off either way: a run dominated by activations, its peak RSS against the
    # estimate made in the same process before it trains, as run.sh's check makes it (measured
    # 1.0-1.35x the estimate on the project's CPU machine)
    args = tiny_args(
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        "--seq-length",
        "8192",
        "--hidden-size",
        "128",
        "--global-batch-size",
        "2",
        "--train-iters",
        "1",
        "--lr-warmup-iters",
        "0",
        "--eval-iters",
        "0",
    )
    measure = (
        "import resource, sys, pretrain_gpt\n"
        "from megazpp.training.memory_check import estimate_peak\n"
        "from megazpp.training.startup import prepare\n"
        "start = prepare(sys.argv[1:], 1)\n"
        "e = estimate_peak(start.options, 1)\n"
        "print('estimate', e.total, e.activations)\n"
        "pretrain_gpt.main(sys.argv[1:])\n"
        "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", measure, *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    said = {
        line.split()[0]: [float(x) for x in line.split()[1:]]
        for line in child.stdout.splitlines()
        if line.startswith(("estimate ", "peak "))
    }
    (estimate, activations), (peak,) = said["estimate"], said["peak"]
    assert activations > 0.3 * peak  # the case the estimate is for
    assert 0.6 * peak < estimate < 1.5 * peak, (estimate, peak)


def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


@pytest.mark.slow
def test_one_job_writes_a_save_directory(tmp_path, run_sh_data_dir, tiny_indexed_prefix, tiny_tokenizer_model):
    save = tmp_path / "ckpt"
    args = tiny_args(
        tiny_indexed_prefix, tiny_tokenizer_model, "--eval-iters", "0", "--save", str(save), "--save-interval", "100000"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *args, "--train-iters", "1000000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lock = save / save_lock.LOCK_FILE
        _wait_for(lock)
        held = lock.read_bytes()
        assert json.loads(held)["pid"] == first.pid
        # the second job: used to die at its first save with "No such file or directory"
        one_line_refusal(
            run_sh(
                run_sh_data_dir,
                *TINY,
                "--save",
                str(save),
                "--tensorboard-dir",
                str(tmp_path / "tb"),
                nproc=2,
                ok=False,
            ),
            f"--save {save} is in use by another job: {lock} is held by pid {first.pid} on host {socket.gethostname()}",
            "which is running",
        )
        assert lock.read_bytes() == held and first.poll() is None
        refused(pretrain(*args, "--train-iters", "2"))
    finally:
        first.kill()
        first.wait()
    # the holder died without removing it (SIGKILL): the next job takes it over, saying so
    out = pretrain(*args, "--train-iters", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (f"--save {save}: taking over the lock of pid {first.pid} on host {socket.gethostname()}") in out.stdout
    assert f"pid {first.pid} is no longer running" in out.stdout
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "latest"]


def _lock(save: Path, **fields: object) -> None:
    save.mkdir(parents=True, exist_ok=True)
    me = save_lock.this_process()
    holder = {
        "host": me.host,
        "pid": me.pid,
        "start_ticks": me.start_ticks,
        "boot_id": me.boot_id,
        "since": me.since,
        **fields,
    }
    (save / save_lock.LOCK_FILE).write_text(json.dumps(holder))


def test_a_lock_is_live_stale_or_foreign(tmp_path):
    save = tmp_path / "ckpt"
    parent = os.getppid()  # alive, and not this process
    _lock(save, pid=parent, start_ticks=save_lock._start_ticks(parent))
    with pytest.raises(CheckpointError, match=f"held by pid {parent} on host .*, which is running"):
        save_lock.check_save_lock(str(save))
    # the same pid, but started at another time: the pid was reused, the holder is gone
    _lock(save, pid=parent, start_ticks=save_lock._start_ticks(parent) - 1)
    save_lock.check_save_lock(str(save))
    path = save_lock.acquire(str(save))
    assert json.loads(path.read_text())["pid"] == os.getpid()
    save_lock.release(path)
    assert not path.exists()
    # another host's job cannot be checked from here: refused, saying how to remove the lock
    _lock(save, host="other-node-7", pid=parent)
    lock = save / save_lock.LOCK_FILE
    with pytest.raises(
        CheckpointError,
        match=(
            f"locked by pid {parent} on host other-node-7 .*cannot be checked from "
            f"{socket.gethostname()}; if that job is no longer running, remove the lock "
            rf"\(rm {lock}\)"
        ),
    ):
        save_lock.acquire(str(save))
    assert json.loads(lock.read_text())["host"] == "other-node-7"
    # a host that rebooted since
    _lock(save, pid=parent, boot_id="another-boot")
    save_lock.check_save_lock(str(save))
