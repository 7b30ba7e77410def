"""Elastic islands as a user runs them (docs/arch/elastic.md): the membership service
(`python -m megazpp.launch.lighthouse`) and three islands, each its own `run.sh` job of one rank
(tiny model, gloo); island 2 is killed (SIGKILL, its whole process tree) after the first outer
sync. The other two reach their next syncs without it and finish: the log says island 2 was
dropped and why, their parameters are equal bit for bit at every sync (their checkpoints, saved
at the syncs), and each trained every inner step once. Plus the refusals of the elastic flags,
in one line before any rank starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ROOT, free_port, paused_at, run_sh_variables

from megazpp.analysis.event_reader import read_run
from megazpp.checkpoint.format import rank_file_name
from tests.test_first_hour import TINY, one_line_refusal, run_sh

H, ITERS = 4, 12
ELASTIC = ["--outer-algorithm", "diloco", "--outer-elastic", "--outer-sync-every", str(H)]
# The lighthouse drops a replica whose heartbeats stop after this; the join timeout is the grace
# a sync gives the heartbeating islands once min-islands have asked (the islands start at
# different times on a loaded machine; a missed first sync would leave one behind).
HEARTBEAT_MS, JOIN_MS = 1500, 20000
# one train dataset for every island of a job, whatever its batch or length (the islands' global
# sample order runs through it; docs/arch/elastic.md); a later --outer-train-samples in `extra` wins
TRAIN_SAMPLES = 1000


def start_island(
    data: Path,
    island: int,
    lighthouse: int,
    tmp: Path,
    *extra: str,
    iters: int = ITERS,
    log_name: str = "",
    nproc: int = 1,
    pause_at: str | None = "elastic_start",
    node: Sequence[str] = (),
    node_env: dict[str, str] | None = None,
    lighthouse_host: str = "127.0.0.1",
) -> subprocess.Popen[str]:
    """One island: `run.sh` on `nproc` ranks with its own store port, checkpoint every sync (into
    `ckpt<I>`, which it resumes from), in a process group of its own (so the whole island can be
    killed at once); unless `pause_at` is None (one rank only: every rank would pause on the one
    file), held at that pause point (megazpp/pause.py; by default `elastic_start`, once its
    membership heartbeats the lighthouse), the file `ready<I><log_name>`; its output in
    `island<I><log_name>.log`. `node`: the command that runs it on another node (netlab's
    `run NODE`), `node_env` that node's variables (its MASTER_ADDR), `lighthouse_host` the
    lighthouse's address from there."""
    env = {**os.environ, **run_sh_variables(data, nproc, MAX_RESTARTS="0"), **(node_env or {})}
    if pause_at is not None:
        env.update(paused_at(pause_at, tmp / f"ready{island}{log_name}"))
    args = [*TINY, "--train-iters", str(iters), "--log-interval", "1", "--save-interval", str(H)]
    args += [
        "--save",
        str(tmp / f"ckpt{island}"),
        "--tensorboard-dir",
        str(tmp / f"tb{island}"),
        *ELASTIC,
        "--outer-lighthouse",
        f"{lighthouse_host}:{lighthouse}",
    ]
    args += ["--outer-island-id", str(island), "--outer-min-islands", "2", "--outer-sync-timeout-s", "10"]
    args += ["--outer-train-samples", str(TRAIN_SAMPLES), *extra]
    log = (tmp / f"island{island}{log_name}.log").open("w")
    return subprocess.Popen(
        [*node, "bash", str(ROOT / "run.sh"), *args],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(
    what: str, ready: Callable[[], bool], procs: Sequence[subprocess.Popen[Any]], timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for p in procs:
            assert p.poll() is None, f"an island ended (rc {p.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def held(tmp: Path, names: Sequence[str], procs: Sequence[subprocess.Popen[Any]]) -> list[Path]:
    """The ready files `ready<name>` of the islands `names`, once each is held at its pause point
    (the timeout only bounds a broken run: an island that ends fails the wait at once)."""
    ready = [tmp / f"ready{n}" for n in names]
    wait_for(f"islands {', '.join(names)} held", lambda: all(f.exists() for f in ready), procs, timeout_s=600)
    return ready


def release(tmp: Path, names: Sequence[str], procs: Sequence[subprocess.Popen[Any]]) -> None:
    """Once the islands `names` are all held at their pause points (at `elastic_start`: they
    heartbeat), let them go together."""
    for f in held(tmp, names, procs):
        f.unlink()


def kill_island(proc: subprocess.Popen[str]) -> None:
    """SIGKILL to the island's whole process tree (run.sh, its launcher, its ranks)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def finish(tmp: Path, islands: dict[str, subprocess.Popen[str]], timeout_s: float = 300) -> None:
    """Each island (by its log's name, `island<name>.log`) ends by itself with exit code 0."""
    for name, p in islands.items():
        assert p.wait(timeout=timeout_s) == 0, (tmp / f"island{name}.log").read_text()[-3000:]


def stop_all(islands: Sequence[subprocess.Popen[str]], lighthouse: subprocess.Popen[bytes]) -> None:
    """Kill what still runs of `islands`, then stop the lighthouse."""
    for p in islands:
        if p.poll() is None:
            kill_island(p)
    lighthouse.send_signal(signal.SIGTERM)
    lighthouse.wait(timeout=30)


def snapshot_at(tmp: Path, island: int, iteration: int, dp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The island's model parameters, outer snapshot and inner AdamW moments (averaged across
    islands at every sync, the default `outer.optimizer_state_every`) as saved at `iteration`
    (a sync) by its rank `dp_rank`."""
    state = torch.load(
        tmp / f"ckpt{island}" / f"iter_{iteration:07d}" / rank_file_name(0, 0, dp_rank),
        map_location="cpu",
        weights_only=False,
    )
    moments = {
        f"optimizer.{i}.{name}": t
        for i, per_param in state["engine"]["optimizer"]["state"].items()
        for name, t in per_param.items()
        if name in ("exp_avg", "exp_avg_sq")
    }
    assert moments, "no AdamW moments saved"
    return {
        **{f"model.{k}": v for k, v in state["model"].items()},
        "snapshot": state["engine"]["outer"]["snapshot"],
        **moments,
    }


def start_lighthouse(
    tmp: Path, min_islands: int, join_ms: int = JOIN_MS, node: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """The membership service as a user starts it, on a free port, once it listens (on another
    node when `node` is netlab's `run NODE`)."""
    port, lighthouse_log = free_port(), tmp / "lighthouse.log"
    lighthouse = subprocess.Popen(
        [*node, sys.executable, "-m", "megazpp.launch.lighthouse", "--min-islands", str(min_islands)]
        + ["--port", str(port), "--heartbeat-timeout-ms", str(HEARTBEAT_MS), "--join-timeout-ms", str(join_ms)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=lighthouse_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    wait_for("the lighthouse", lambda: "lighthouse: listening at " in lighthouse_log.read_text(), [lighthouse])
    return lighthouse, port


def sync_lines(out: str, island: int) -> list[tuple[str, str, str, str]]:
    """(sync, step, islands, tokens) of each outer sync island `island` logged."""
    return re.findall(
        rf"outer: island {island}, outer sync (\d+) at step (\d+): islands (\d+(?:,\d+)*), tokens (\d+(?:,\d+)*)", out
    )


def trained_steps(out: str, iters: int) -> list[int]:
    """The iteration lines' steps, in order."""
    return [int(m) for m in re.findall(rf"^\s*iter\s+(\d+)/{iters} \| loss ", out, flags=re.M)]


@pytest.mark.slow
def test_three_islands_one_killed_the_others_sync_and_finish(run_sh_data_dir, tmp_path):
    lighthouse, port = start_lighthouse(tmp_path, 2)
    islands: list[subprocess.Popen[str]] = []
    try:
        # island 2 trains 3x the others' batch per step: its steps are slower and weigh 3x
        islands = [start_island(run_sh_data_dir, i, port, tmp_path) for i in range(2)]
        islands.append(start_island(run_sh_data_dir, 2, port, tmp_path, "--global-batch-size", "12"))
        release(tmp_path, ["0", "1", "2"], islands)
        log2 = tmp_path / "island2.log"
        wait_for("island 2's first sync", lambda: "outer sync 1 at step 4" in log2.read_text(), islands)
        kill_island(islands[2])
        finish(tmp_path, {"0": islands[0], "1": islands[1]}, timeout_s=120)
    finally:
        stop_all(islands, lighthouse)
    logs = [(tmp_path / f"island{i}.log").read_text() for i in range(2)]
    for i, out in enumerate(logs):
        syncs = sync_lines(out, i)
        # sync 1 with all three, token-weighted: 4 steps x 4 samples x 32 tokens, island 2 three times
        # that; syncs 2 and 3 without island 2
        assert syncs[0] == ("1", "4", "0,1,2", "512,512,1536"), syncs
        assert [s[:3] for s in syncs[1:]] == [("2", "8", "0,1"), ("3", "12", "0,1")], syncs
        assert "outer: island 2 dropped at outer sync 2 (absent from the quorum: no heartbeat" in out, out[-3000:]
        assert "outer: island 2 joined at the start after outer sync 0" in out
        assert f"outer: island {i} leaves after outer sync 3 (run finished)" in out
        # every inner step once: the iteration lines 1..12, in order
        steps = trained_steps(out, ITERS)
        assert steps == list(range(1, ITERS + 1)), steps
        assert list(read_run(tmp_path / f"tb{i}", "two-level").scalars["outer/islands_live"].values) == [3, 2, 2]
    for it in (H, 2 * H, 3 * H):
        a, b = snapshot_at(tmp_path, 0, it), snapshot_at(tmp_path, 1, it)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (it, k)


def test_elastic_without_a_lighthouse_is_refused_in_one_line(run_sh_data_dir):
    """run.sh's check, before any rank (the other elastic refusals: tests/test_outer_settings.py)."""
    refused = run_sh(
        run_sh_data_dir, *TINY, "--train-iters", "8", "--outer-algorithm", "diloco", "--outer-elastic", ok=False
    )
    one_line_refusal(refused, "outer.elastic needs the membership service's HOST:PORT (--outer-lighthouse")


def test_an_island_whose_lighthouse_does_not_answer_is_refused_in_one_line(run_sh_data_dir):
    """run.sh's check probes the lighthouse before any rank builds a model (nothing listens on a
    free port)."""
    port = free_port()
    refused = run_sh(
        run_sh_data_dir,
        *TINY,
        "--train-iters",
        "8",
        *ELASTIC,
        "--outer-lighthouse",
        f"127.0.0.1:{port}",
        ok=False,
    )
    one_line_refusal(refused, f"outer.lighthouse = 127.0.0.1:{port}: nothing answers there (Connection refused)")


@pytest.mark.slow
def test_a_second_island_with_a_running_islands_id_is_refused_and_the_running_one_goes_on(run_sh_data_dir, tmp_path):
    """Island 0 runs alone (the lighthouse needs 1); a newcomer that also says `--outer-island-id
    0` (its own checkpoints) is held before its start exchange and island 0 before its 2nd sync's
    quorum, then both let go, the newcomer first, so they meet at island 0's sync 2. Island 0
    trained there and the newcomer did not: the newcomer stops with one line, island 0 votes no,
    redoes the sync without it and finishes: no join, every inner step once."""
    lighthouse, port = start_lighthouse(tmp_path, 1)
    islands: list[subprocess.Popen[str]] = []
    try:
        alone = ["--outer-min-islands", "1"]
        islands.append(start_island(run_sh_data_dir, 0, port, tmp_path, *alone, pause_at="elastic_sync@2"))
        held(tmp_path, ["0"], islands)
        twin = [*alone, "--save", str(tmp_path / "ckpt_twin"), "--tensorboard-dir", str(tmp_path / "tb_twin")]
        islands.append(
            start_island(run_sh_data_dir, 0, port, tmp_path, *twin, log_name="twin", pause_at="elastic_join")
        )
        release(tmp_path, ["0twin"], islands)
        time.sleep(1.0)  # the newcomer asks first: the quorum waits for island 0, which heartbeats
        release(tmp_path, ["0"], islands[:1])
        assert islands[1].wait(timeout=300) != 0
        finish(tmp_path, {"0": islands[0]})
    finally:
        stop_all(islands, lighthouse)
    refusal = "outer: islands [0, 0] met at outer sync 2: two islands have id 0 (--outer-island-id must differ"
    twin_log = (tmp_path / "island0twin.log").read_text()
    assert f"pretrain_gpt.py: error: {refusal}" in twin_log, twin_log[-3000:]
    out = (tmp_path / "island0.log").read_text()
    assert f"outer: island 0: outer sync 2 failed ({refusal}" in out, out[-3000:]
    assert [s[:3] for s in sync_lines(out, 0)] == [("1", "4", "0"), ("2", "8", "0"), ("3", "12", "0")]
    assert "joined at outer sync" not in out
    assert trained_steps(out, ITERS) == list(range(1, ITERS + 1))
