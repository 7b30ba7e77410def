"""Real signals sent to real runs: SIGTERM and SIGINT finish the step, save and exit 0 with a
line naming the checkpoint; a second signal exits at once; `--exit-duration-in-mins` stops
the same way; and through `run.sh` a SIGTERM sent to the launcher reaches every rank, which
agree on the step to stop after (one rank signalled alone stops them all)."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import (
    ROOT,
    TINY_MODEL_FLAGS,
    as_from_a_terminal,
    checkout_env,
    paused_at,
    run_sh_variables,
    wait_until_paused,
)
from test_training_pretrain import tiny_args

LONG = "5000"  # iterations: the runs are stopped long before


class Run:
    """A subprocess whose merged output is read by a thread, so a test can wait for a line
    without blocking forever."""

    def __init__(self, command: list[str], env_extra: dict[str, str] | None = None) -> None:
        env = checkout_env(**{"PYTHONUNBUFFERED": "1", **(env_extra or {})})
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=as_from_a_terminal,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    # the timeouts bound a broken run only (each wait ends at a line or an exit): generous, so
    # that a loaded machine's slowness is never taken for a fault
    def wait_for(self, pattern: str, timeout: float = 900) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        self.proc.kill()
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code, "\n".join(self.lines)


def pretrain_command(prefix, tokenizer, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "pretrain_gpt.py"),
        *tiny_args(prefix, tokenizer, "--eval-iters", "0", "--log-interval", "1", *extra),
    ]


def stopped_at(output: str, why: str, ckpt: Path) -> int:
    match = re.search(
        rf"stopped after iteration (\d+) \({why}\): saved checkpoint "
        rf"{re.escape(str(ckpt))}/iter_(\d+)",
        output,
    )
    assert match and match[1] == str(int(match[2])), output[-3000:]
    assert (ckpt / "latest").read_text() == f"iter_{int(match[1]):07d}\n"
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    return int(match[1])


@pytest.mark.slow
def test_sigterm_and_sigint_save_and_exit_0(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    ckpt = tmp_path / "ckpt"
    command = pretrain_command(
        tiny_indexed_prefix, tiny_tokenizer_model, "--train-iters", LONG, "--save", str(ckpt), "--save-interval", "1000"
    )
    run = Run(command)
    run.wait_for(r"^iter +3/")
    run.proc.send_signal(signal.SIGTERM)  # what a scheduler sends before SIGKILL
    code, output = run.finish()
    assert code == 0, output[-3000:]
    assert "SIGTERM received: finishing this step, then saving" in output
    first = stopped_at(output, "SIGTERM", ckpt)
    assert first >= 3

    run = Run(command)  # resumes from --save; Ctrl-C gave a traceback and no checkpoint
    run.wait_for(rf"resumed from {re.escape(str(ckpt))}/iter_{first:07d} at iteration {first}")
    run.wait_for(rf"^iter +{first + 2}/")
    run.proc.send_signal(signal.SIGINT)
    code, output = run.finish()
    assert code == 0, output[-3000:]
    assert stopped_at(output, "SIGINT", ckpt) >= first + 2


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_exit_duration_stops(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    ckpt = tmp_path / "ckpt"
    # the run waits at the start of its evaluation after step 3 (a pause point), so the first
    # signal's stop stays pending there for as long as the test takes, whatever the load
    pause = tmp_path / "paused"
    run = Run(
        pretrain_command(
            tiny_indexed_prefix,
            tiny_tokenizer_model,
            "--train-iters",
            LONG,
            "--save",
            str(ckpt),
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
        ),
        env_extra=paused_at("evaluation", pause),
    )
    wait_until_paused(run.proc, pause)
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("SIGINT received: finishing this step")
    time.sleep(1.5)  # a repeat within a second is the same request (a forwarded copy)
    run.proc.send_signal(signal.SIGINT)
    code, output = run.finish()
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert "second SIGINT received: exiting at once, without saving" in output
    assert not (ckpt / "latest").exists() and not list(ckpt.glob("iter_*"))

    run = Run(
        pretrain_command(
            tiny_indexed_prefix,
            tiny_tokenizer_model,
            "--train-iters",
            LONG,
            "--save",
            str(ckpt),
            "--exit-duration-in-mins",
            "0.002",
        )
    )
    code, output = run.finish(timeout=900)
    assert code == 0, output[-3000:]
    # 0.12 s from the program's start, setup included (as Megatron counts): over by step 1
    assert stopped_at(output, r"--exit-duration-in-mins 0\.002", ckpt) == 1


def run_sh(tmp_path: Path, data_dir: Path, *extra: str, env_extra: dict[str, str]) -> Run:
    env = run_sh_variables(data_dir, 2, **env_extra)
    args = [
        *TINY_MODEL_FLAGS,
        "--global-batch-size",
        "8",
        "--lr-warmup-iters",
        "2",
        "--eval-iters",
        "0",
        "--split",
        "90,10,0",
        "--log-interval",
        "1",
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        *extra,
    ]
    return Run(["bash", str(ROOT / "run.sh"), *args], env_extra=env)


def run_sh_data(tmp_path: Path, prefix: str, tokenizer: Path) -> Path:
    data = tmp_path / "data"  # the layout run.sh expects, pointing at the shared tiny dataset
    (data / "corpus").mkdir(parents=True)
    (data / "tokenizer.model").symlink_to(tokenizer)
    for suffix in (".bin", ".idx"):
        (data / f"corpus_text_document{suffix}").symlink_to(f"{prefix}{suffix}")
    return data


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(
    tmp_path, tiny_indexed_prefix, tiny_tokenizer_model
):
    data = run_sh_data(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model)
    ckpt = tmp_path / "ckpt"
    run = run_sh(tmp_path, data, "--train-iters", LONG, "--save", str(ckpt), env_extra={})
    run.wait_for(r"^iter +3/")
    run.proc.send_signal(signal.SIGTERM)  # run.sh execs the launcher: this is its pid
    code, output = run.finish()
    assert code == 0, output[-3000:]
    assert re.search(r"node_launcher: SIGTERM received: forwarded to this node's ranks \[\d+, \d+\]", output), output[
        -3000:
    ]
    stopped = stopped_at(output, "SIGTERM", ckpt)
    assert sorted(p.name for p in (ckpt / f"iter_{stopped:07d}").iterdir()) == [
        "metadata.json",
        "rank_tp00_pp000_dp0000.pt",
        "rank_tp00_pp000_dp0001.pt",
    ]

    # one rank alone signalled (after step 3): every rank stops after step 3
    ckpt = tmp_path / "ckpt_one_rank"
    run = run_sh(
        tmp_path,
        data,
        "--train-iters",
        LONG,
        "--save",
        str(ckpt),
        env_extra={"MEGAZPP_FAULT": "sigterm_after_step@3:1"},
    )
    code, output = run.finish(timeout=900)
    assert code == 0, output[-3000:]
    assert stopped_at(output, "a signal on another rank", ckpt) == 3
