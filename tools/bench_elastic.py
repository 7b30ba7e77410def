#!/usr/bin/env python3
"""Elastic islands against failures (issue 38): useful inner steps per second with one island
killed (`kill -9` of its whole process tree) and restarted every K seconds, against the
failure-free run's, on netlab; beside it the same failures on the synchronous restart path.

    sudo python tools/bench_elastic.py                                     # the issue's scale
    sudo python tools/bench_elastic.py --kill-every 60 --duration 240 --ranks-per-island 1

Each island is a netlab node (`tools/netlab.sh`, links at --rate) and a job started as users
start it, `bash run.sh`. Four runs, in order, each --duration seconds from its first outer sync:
- elastic-steady: the lighthouse (`python -m megazpp.launch.lighthouse`, node 0) and every
  island its own `run.sh ... --outer-elastic` (DiLoCo every H steps, each checkpointing into
  its own directory), no failure;
- elastic-failures: the same, and every K seconds island 1, 2, ... in turn is killed and started
  again at once (it resumes from its checkpoint and heals from a live peer);
- sync-steady: today's two-level path, one torchrun world over every island's ranks (one
  `run.sh` per node, NNODES = islands, MAX_RESTARTS), the same islands, H and per-island batch;
- sync-failures: the same kills; the world restarts from its last checkpoint.
Both paths checkpoint every --save-interval steps (default H: every sync, the synchronous path's
best case), keeping the newest two (`--keep-last 2`). Node 0 hosts the job's services (the
lighthouse; torchrun's rendezvous store), which the kills leave alone.

Useful inner steps (benchmarks/elastic_log.py): the steps merged at the syncs inside the window
(elastic), every island's steps up to its last sync (synchronous). Time to detect: a kill to the
survivors' sync that dropped the island; time to rejoin: its restart to the sync where it healed;
the synchronous path's time back: a kill to its first sync past the one it had reached. Each
run's stamped logs, `events.log` (kills, restarts), `result.json`, and OUT/elastic.md and
OUT/elastic.json. Arguments after `--` go to every island's run.sh (pretrain_gpt.py flags);
--global-batch-size there is per island. Needs root and the sample data (data/, `bash run.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)
from bench_netlab import check_data

from benchmarks import elastic_log, launch
from megazpp.cli import add_out_flag, run_tool
from megazpp.config.checks import validate_config
from megazpp.config.load import load_config
from megazpp.errors import LaunchError, required
from megazpp.launch.proc_tree import process_tree

REPO = Path(__file__).resolve().parents[1]
RUNS = ("elastic-steady", "elastic-failures", "sync-steady", "sync-failures")
LIGHTHOUSE_PORT, ISLAND_PORT = 29510, 29520  # inside netlab's namespaces: nothing else listens there


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, extra = launch.split_passthrough(argv)
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--ranks-per-island", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=20, help="H, inner steps per outer sync")
    p.add_argument("--kill-every", type=float, default=300.0, help="K: seconds between kills")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds measured per run, from its first sync")
    p.add_argument("--rate", default="1gbit", help="netlab link rate (tc syntax)")
    p.add_argument("--delay", default="0", help="netlab link delay (tc syntax; 0: none)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="the lighthouse's (its default)")
    p.add_argument("--join-timeout-ms", type=int, default=60000, help="the lighthouse's (its default)")
    p.add_argument("--save-interval", type=int, default=None, help="checkpoint every N steps (default: H)")
    p.add_argument("--train-iters", type=int, default=100000, help="each job's (never reached: runs are stopped)")
    p.add_argument("--config", default="configs/llama_tiny.yaml")
    p.add_argument("--data-dir", default="data", help="run.sh's DATA_DIR (the sample data)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a run may take to its first sync")
    p.add_argument("--report", action="store_true", help="only measure the runs already in --out again (no netlab)")
    add_out_flag(p, default="runs/bench_elastic", help="result directory")
    ns = p.parse_args(argv)
    ns.extra = extra
    ns.runs = [r for r in ns.runs.split(",") if r]
    unknown = [r for r in ns.runs if r not in RUNS]
    if unknown or not ns.runs:
        p.error(f"--runs {','.join(ns.runs)}: expected names of {', '.join(RUNS)}")
    if ns.islands < 2 or ns.ranks_per_island < 1 or ns.sync_every < 1:
        p.error("expected --islands >= 2, --ranks-per-island >= 1, --sync-every >= 1")
    if ns.kill_every <= 0 or ns.duration <= 0:
        p.error("expected positive --kill-every and --duration seconds")
    ns.save_interval = ns.save_interval or ns.sync_every
    return ns


class Clock:
    """Seconds since the benchmark started: every log line and event is stamped with it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


@dataclass
class Job:
    """One process tree (an island's run.sh, or the lighthouse) whose output is stamped into `log`."""

    proc: subprocess.Popen[str]
    log: Path
    reader: threading.Thread = field(repr=False)


def start(command: list[str], env: dict[str, str], log: Path, clock: Clock) -> Job:
    proc = subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def copy(out: IO[str], to: IO[str]) -> None:
        with to:
            for line in out:
                to.write(elastic_log.stamp(clock.now(), line.rstrip("\n")) + "\n")
                to.flush()

    assert proc.stdout is not None
    reader = threading.Thread(target=copy, args=(proc.stdout, log.open("w")), daemon=True)
    reader.start()
    return Job(proc, log, reader)


def kill_tree(job: Job) -> None:
    """`kill -9` of the job's whole process tree (torchrun starts its ranks in sessions of their
    own, so a process group does not reach them; stopped first, so nothing forks meanwhile)."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in process_tree(job.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    job.proc.wait()
    job.reader.join(timeout=30)


def island_env(ns: argparse.Namespace, run: str, island: int) -> dict[str, str]:
    """run.sh's variables for island `island` (netlab node `island`) of run `run`."""
    elastic = run.startswith("elastic")
    env = run_sh_env(
        ns,
        nnodes=1 if elastic else ns.islands,
        node_rank=0 if elastic else island,
        master=f"{launch.node_addr(ns.rate, island if elastic else 0)}:{ISLAND_PORT + RUNS.index(run)}",
        # the synchronous world restarts after each kill (a failed re-rendezvous counts too)
        max_restarts=0 if elastic else 10 * int(ns.duration / ns.kill_every + 1),
    )
    return {**env, **launch.NETLAB_ENV}


def run_sh_env(ns: argparse.Namespace, nnodes: int, node_rank: int, master: str, max_restarts: int) -> dict[str, str]:
    """run.sh's variables for one node of a job of --ranks-per-island ranks per node: this
    checkout's code, unbuffered output (the benchmark stamps each line as it comes), the sample
    data, and the rendezvous at `master` (HOST:PORT)."""
    addr, _, port = master.rpartition(":")
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "DATA_DIR": os.path.abspath(ns.data_dir),
        "NPROC_PER_NODE": str(ns.ranks_per_island),
        "NNODES": str(nnodes),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
        "MAX_RESTARTS": str(max_restarts),
    }


def island_args(ns: argparse.Namespace, run: str, island: int, run_dir: Path, batch: int) -> list[str]:
    """run.sh's flags: the config and the flags after `--`, then what the measurement needs (a
    line per iteration, checkpoints, the outer flags, the per-island batch), which win over them."""
    elastic = run.startswith("elastic")
    save = run_dir / (f"ckpt{island}" if elastic else "ckpt")
    args = ["--config", ns.config, "--train-iters", str(ns.train_iters), "--eval-interval", str(ns.train_iters)]
    args += [*ns.extra, "--log-interval", "1", "--save", str(save), "--save-interval", str(ns.save_interval)]
    args += ["--keep-last", "2"]  # a checkpoint per sync for 20 minutes would fill the disk
    args += ["--tensorboard-dir", str(run_dir / f"tb{island if elastic else ''}")]
    args += ["--outer-algorithm", "diloco", "--outer-sync-every", str(ns.sync_every)]
    if elastic:
        lighthouse = f"{launch.node_addr(ns.rate, 0)}:{LIGHTHOUSE_PORT}"
        args += ["--outer-elastic", "--outer-lighthouse", lighthouse, "--outer-island-id", str(island)]
        args += ["--outer-min-islands", "2", "--global-batch-size", str(batch)]
    else:  # the world's global batch: every island's
        args += ["--global-batch-size", str(batch * ns.islands)]
    return args


def start_island(
    ns: argparse.Namespace, run: str, island: int, run_dir: Path, batch: int, log: Path, clock: Clock
) -> Job:
    command = [
        "bash",
        launch.NETLAB,
        "run",
        str(island),
        "bash",
        "run.sh",
        *island_args(ns, run, island, run_dir, batch),
    ]
    return start(command, island_env(ns, run, island), log, clock)


def start_lighthouse(ns: argparse.Namespace, run_dir: Path, clock: Clock) -> Job:
    command = ["bash", launch.NETLAB, "run", "0", sys.executable, "-m", "megazpp.launch.lighthouse"]
    command += ["--min-islands", "2", "--port", str(LIGHTHOUSE_PORT)]
    command += ["--heartbeat-timeout-ms", str(ns.heartbeat_timeout_ms), "--join-timeout-ms", str(ns.join_timeout_ms)]
    job = start(
        command, {**os.environ, **launch.NETLAB_ENV, "PYTHONPATH": str(REPO)}, run_dir / "lighthouse.log", clock
    )
    wait_for(lambda: "lighthouse: listening at " in job.log.read_text(), [job], 60.0, "the lighthouse")
    return job


def wait_for(ready: Callable[[], bool], jobs: list[Job], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for job in jobs:
            if job.proc.poll() is not None:
                tail = job.log.read_text()[-2000:] if job.log.exists() else ""
                raise LaunchError(f"{job.log} ended (exit {job.proc.returncode}) before {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise LaunchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def first_sync(run: str, logs: list[Path], sync_every: int) -> float | None:
    """When the run's first outer sync was logged (the window's start), or None yet."""
    lines = [elastic_log.read(p) for p in logs if p.exists()]
    if run.startswith("elastic"):
        found = elastic_log.syncs(lines)
        return min((s.t for s in found.values()), default=None)
    steps = elastic_log.sync_steps(lines[0], sync_every) if lines else []
    return steps[0][0] if steps else None


def run_one(ns: argparse.Namespace, run: str, batch: int, clock: Clock) -> Path:
    """One run, from start to `duration` seconds after its first sync; its stamped logs,
    events.log and window.json in OUT/<run>. A process that ends by itself meanwhile (a
    synchronous world out of restarts, an island that failed) is noted in window.json's status
    and left ended: what the job did without it is the measurement."""
    run_dir = Path(ns.out).resolve() / run
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    services = [start_lighthouse(ns, run_dir, clock)] if run.startswith("elastic") else []
    islands = {
        i: start_island(ns, run, i, run_dir, batch, run_dir / f"island{i}.log", clock) for i in range(ns.islands)
    }
    events = (run_dir / "events.log").open("w")
    try:
        logs = [islands[0].log] if run.startswith("sync") else [j.log for j in islands.values()]
        wait_for(
            lambda: first_sync(run, logs, ns.sync_every) is not None,
            [*services, *islands.values()],
            ns.start_timeout,
            f"{run}'s first outer sync",
        )
        begin = first_sync(run, logs, ns.sync_every)
        assert begin is not None
        kills, load, ended = 0, list[float](), list[str]()
        while clock.now() < begin + ns.duration:
            due = begin + (kills + 1) * ns.kill_every
            if run.endswith("failures") and clock.now() >= due:
                kills += 1
                victim = 1 + (kills - 1) % (ns.islands - 1)
                kill_tree(islands[victim])
                events.write(elastic_log.stamp(clock.now(), f"kill island {victim} {islands[victim].log.name}") + "\n")
                log = run_dir / f"island{victim}.{kills}.log"
                islands[victim] = start_island(ns, run, victim, run_dir, batch, log, clock)
                events.write(elastic_log.stamp(clock.now(), f"restart island {victim} {log.name}") + "\n")
                events.flush()
            for job in [*services, *islands.values()]:
                note = f"{job.log.name} ended (exit {job.proc.returncode}) at {clock.now():.1f} s"
                if job.proc.poll() is not None and not any(n.startswith(job.log.name) for n in ended):
                    print(f"[{run}] {note}", flush=True)
                    ended.append(note)
            load.append(os.getloadavg()[0])
            time.sleep(0.2)
    finally:
        events.close()
        for job in [*islands.values(), *services]:
            kill_tree(job)
    status = "; ".join(ended) or "ok"
    window = {"begin": begin, "end": begin + ns.duration, "load": sum(load) / max(1, len(load)), "status": status}
    (run_dir / "window.json").write_text(json.dumps(window))
    return run_dir


@dataclass
class Result:
    run: str
    kills: int
    window_s: float
    useful_steps: float
    steps_per_s: float
    trained_steps: int  # every island's inner steps trained in the window, merged or not
    detect_s: list[float | None]  # elastic: kill -> the sync that dropped it
    rejoin_s: list[float | None]  # elastic: restart -> the sync it healed in
    back_s: list[float | None]  # synchronous: kill -> its first sync past where it was
    load: float  # the machine's 1-minute load average, averaged over the window
    status: str  # "ok", or which processes ended by themselves during the window


def measure(run_dir: Path, run: str, islands: int, sync_every: int, tokens_per_step: int) -> Result:
    """The run's numbers, from its logs alone (`benchmarks/elastic_log.py`)."""
    window = json.loads((run_dir / "window.json").read_text())
    begin, end = float(window["begin"]), float(window["end"])
    events = elastic_log.events(run_dir / "events.log")
    kills = [e for e in events if e.kind == "kill"]
    logs = {p.name: elastic_log.read(p) for p in sorted(run_dir.glob("island*.log"))}
    if run.startswith("elastic"):
        useful = elastic_log.merged_steps(elastic_log.syncs(logs.values()), begin, end, tokens_per_step)
        trained = sum(elastic_log.trained_steps(lines, begin, end) for lines in logs.values())
        restarts = [e for e in events if e.kind == "restart"]
        detect = elastic_log.detect_times(kills, logs, end)
        rejoin = elastic_log.rejoin_times(restarts, logs, end)
        back: list[float | None] = []
    else:
        steps = elastic_log.sync_steps(logs["island0.log"], sync_every)
        useful = islands * (elastic_log.reached(steps, end) - elastic_log.reached(steps, begin))
        trained = islands * elastic_log.trained_steps(logs["island0.log"], begin, end)  # a line: every island's
        detect, rejoin, back = [], [], elastic_log.back_times(kills, steps, end)
    load = float(window["load"])
    steps_per_s = useful / (end - begin)
    status = window["status"]
    return Result(run, len(kills), end - begin, useful, steps_per_s, trained, detect, rejoin, back, load, status)


def fmt(values: list[float | None]) -> str:
    return ", ".join("n/a" if v is None else f"{v:.1f}" for v in values) or "-"


def render(results: list[Result], started: dict[str, str], command: str) -> str:
    """The table; `started`: the measuring command and the load average when it started
    (`command`, when another, measured its runs again)."""
    by = {r.run: r for r in results}
    again = f" (measured again from its logs by `{command}`)" if command != started["command"] else ""
    lines = [
        f"`{started['command']}`{again}",
        "",
        f"load average at the start: {started['load']} (the runs' own: the last column)",
        "",
        "| run | kills | window s | useful inner steps | steps/s | vs its path's failure-free "
        "| vs elastic failure-free | useful / trained "
        "| detect s | rejoin s | back s | load | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        own = by.get(r.run.split("-")[0] + "-steady")
        base = by.get("elastic-steady")
        share = f"{100 * r.useful_steps / r.trained_steps:.1f}%" if r.trained_steps else "n/a"
        ratio = [f"{100 * r.steps_per_s / b.steps_per_s:.1f}%" if b and b.steps_per_s else "n/a" for b in (own, base)]
        lines.append(
            f"| {r.run} | {r.kills} | {r.window_s:.0f} | {r.useful_steps:.0f} | {r.steps_per_s:.2f} | {ratio[0]} | "
            f"{ratio[1]} | {share} | {fmt(r.detect_s)} | {fmt(r.rejoin_s)} | {fmt(r.back_s)} | {r.load:.1f} | "
            f"{r.status} |"
        )
    return "\n".join(lines) + "\n"


def island_run(ns: argparse.Namespace) -> tuple[int, int]:
    """One island's global batch and sequence length: --config with the flags after `--`, checked
    for an island of --ranks-per-island ranks (a bad value stops the tool before any run)."""
    prefix, tokenizer = check_data(ns.data_dir)
    cfg = validate_config(
        load_config(["--config", ns.config, "--data-path", prefix, "--tokenizer-model", tokenizer, *ns.extra]),
        ns.ranks_per_island,
        ns.ranks_per_island,
    )
    return required(cfg.training.global_batch_size, "training.global_batch_size"), cfg.model.seq_length


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(args)
    os.chdir(REPO)
    batch, seq_length = island_run(ns)
    tokens_per_step = batch * seq_length  # one island's inner step
    command = shlex.join(["python", "tools/bench_elastic.py", *args])
    clock, results = Clock(), []
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not ns.report:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        (out / "started.json").write_text(json.dumps({"command": command, "load": load}))
    started = json.loads((out / "started.json").read_text())
    # a SIGTERM unwinds through the runs' and netlab's teardown below; the caller's handler comes back after
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if not ns.report:
            launch.netlab_up(ns.islands, ns.rate, ns.delay)
        for run in ns.runs:
            print(f"[{run}] ...", flush=True)
            run_dir = out / run if ns.report else run_one(ns, run, batch, clock)
            results.append(measure(run_dir, run, ns.islands, ns.sync_every, tokens_per_step))
            (run_dir / "result.json").write_text(json.dumps(asdict(results[-1]), indent=1))
            print(f"[{run}] {results[-1].steps_per_s:.2f} useful inner steps/s", flush=True)
            (out / "elastic.md").write_text(render(results, started, command))
            (out / "elastic.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    finally:
        if not ns.report:
            launch.netlab_down()
        signal.signal(signal.SIGTERM, previous)
    print((out / "elastic.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    run_tool(main)
