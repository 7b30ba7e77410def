#!/usr/bin/env python3
"""Elastic islands' training quality after failures (issue 38): the final validation loss of a
job whose islands were killed and restarted, against the spread over seeds of the same job
without failures that merged the same number of tokens.

    python tools/bench_elastic_quality.py                                  # 3 islands x 2 ranks, seeds 1-3
    python tools/bench_elastic_quality.py --seeds 1,2 --train-iters 40 --kill-at 15

Per seed, two runs of one job as users start it: a lighthouse (`python -m
megazpp.launch.lighthouse`) and each island its own `bash run.sh ... --outer-elastic` on this
machine's loopback, every island --train-iters steps of its own, a checkpoint at every sync:
- steady: no failure;
- failures: at each --kill-at step K, the next of islands 1, 2, ... is killed (`kill -9` of its
  whole process tree) when it logs iteration K, and started again at once; it resumes from its
  checkpoint and meets the others' next sync, and redoes the steps it lost.
The killed island ends after the others (it lost the time of its restart), its last intervals
merged alone (`--outer-min-islands 1`): the job's model is then the last island's, after the
highest outer sync, which every island's work went into. Both runs merge the same tokens (every
island's --train-iters steps; the sync lines' sum, checked); every island is held at
`elastic_start` until all of them heartbeat, so the first sync holds them all and a steady run
is one deterministic job (each of its syncs holding every island: checked, as a warning).

Output: OUT/seed<S>/<run>/ (the islands' stamped logs, events.log, each process's TensorBoard,
result.json), OUT/quality.md and OUT/quality.json. Arguments after `--` go to every island's
run.sh (pretrain_gpt.py flags; --global-batch-size there is per island). Needs the sample data
(data/, `bash run.sh`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)
from bench_elastic import Clock, Job, island_run, kill_tree, run_sh_env, start, wait_for

from benchmarks import elastic_log, launch
from megazpp.analysis.comparison import VAL_LOSS
from megazpp.analysis.event_reader import read_run
from megazpp.cli import add_out_flag, run_tool
from megazpp.launch.node_launcher import free_port

REPO = Path(__file__).resolve().parents[1]
RUNS = ("steady", "failures")
LOOPBACK = "127.0.0.1"


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, extra = launch.split_passthrough(argv)
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--seeds", default="1,2,3", help="comma-separated training seeds (--seed)")
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--ranks-per-island", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=20, help="H, inner steps per outer sync")
    p.add_argument("--train-iters", type=int, default=400, help="every island's steps (a multiple of H)")
    p.add_argument(
        "--kill-at", default="130,250", help="comma-separated steps: a kill each (islands 1, 2, ... in turn)"
    )
    p.add_argument("--eval-iters", type=int, default=20, help="validation batches of the final evaluation")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="the lighthouse's (its default)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("--config", default="configs/llama_tiny.yaml")
    p.add_argument("--data-dir", default="data", help="run.sh's DATA_DIR (the sample data)")
    p.add_argument("--report", action="store_true", help="only measure the runs already in --out again")
    add_out_flag(p, default="runs/bench_elastic_quality", help="result directory")
    ns = p.parse_args(argv)
    ns.extra = extra
    try:
        ns.seeds = [int(s) for s in ns.seeds.split(",") if s]
        ns.kill_at = [int(k) for k in ns.kill_at.split(",") if k]
    except ValueError:
        p.error(f"--seeds {ns.seeds} / --kill-at {ns.kill_at}: expected comma-separated integers")
    if not ns.seeds or ns.islands < 2 or ns.ranks_per_island < 1 or ns.sync_every < 1:
        p.error("expected a seed, --islands >= 2, --ranks-per-island >= 1 and --sync-every >= 1")
    if ns.train_iters < ns.sync_every or ns.train_iters % ns.sync_every:
        p.error(f"--train-iters {ns.train_iters}: expected a multiple of --sync-every {ns.sync_every}")
    steps = [0, *ns.kill_at, ns.train_iters]
    if not ns.kill_at or not all(a < b for a, b in zip(steps, steps[1:])):
        p.error(f"--kill-at {ns.kill_at}: expected increasing steps between 0 and --train-iters {ns.train_iters}")
    return ns


def victim(kill: int, islands: int) -> int:
    """The island the `kill`-th kill (0-based) takes: 1, 2, ..., islands - 1, 1, ... (island 0
    stays, so some island always runs from the start)."""
    return 1 + kill % (islands - 1)


def start_island(
    ns: argparse.Namespace, island: int, seed: int, batch: int, lighthouse: int, run_dir: Path, life: int, clock: Clock
) -> Job:
    """Island `island`'s run.sh; `life` 0 is its first start (held at `elastic_start`, each rank
    on its file `ready<I>.<rank>`), k its restart after the k-th kill (log and TensorBoard of its own)."""
    suffix = f".{life}" if life else ""
    env = run_sh_env(ns, nnodes=1, node_rank=0, master=f"{LOOPBACK}:{free_port()}", max_restarts=0)
    if life == 0:
        env["MEGAZPP_PAUSE_AT"] = f"elastic_start:{run_dir / f'ready{island}'}" + ".{rank}"
    args = ["--config", ns.config, "--train-iters", str(ns.train_iters), "--eval-interval", str(ns.train_iters)]
    args += ["--eval-iters", str(ns.eval_iters), "--seed", str(seed), *ns.extra, "--log-interval", "1"]
    args += ["--save", str(run_dir / f"ckpt{island}"), "--save-interval", str(ns.sync_every), "--keep-last", "2"]
    args += ["--tensorboard-dir", str(run_dir / f"tb{island}{suffix}")]
    args += ["--outer-algorithm", "diloco", "--outer-sync-every", str(ns.sync_every), "--outer-elastic"]
    args += ["--outer-lighthouse", f"{LOOPBACK}:{lighthouse}", "--outer-island-id", str(island)]
    args += ["--outer-min-islands", "1", "--global-batch-size", str(batch)]
    args += ["--outer-train-samples", str(ns.islands * ns.train_iters * batch)]  # one pass for the job
    return start(["bash", "run.sh", *args], env, run_dir / f"island{island}{suffix}.log", clock)


def logged_iteration(job: Job, step: int) -> bool:
    found = (elastic_log.ITERATION.match(line.text) for line in elastic_log.read(job.log))
    return any(m is not None and int(m.group(1)) == step for m in found)


def run_one(ns: argparse.Namespace, seed: int, run: str, batch: int, clock: Clock) -> Path:
    """One run to its end (every island's process exited); an island that failed by itself is
    noted in status.json, and what the job did without it is the measurement."""
    run_dir = Path(ns.out).resolve() / f"seed{seed}" / run
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port = free_port()
    command = [sys.executable, "-m", "megazpp.launch.lighthouse", "--min-islands", "1", "--port", str(port)]
    command += ["--heartbeat-timeout-ms", str(ns.heartbeat_timeout_ms)]
    lighthouse = start(command, {**os.environ, "PYTHONPATH": str(REPO)}, run_dir / "lighthouse.log", clock)
    islands: dict[int, Job] = {}
    events = (run_dir / "events.log").open("w")
    try:
        wait_for(
            lambda: "lighthouse: listening at " in lighthouse.log.read_text(), [lighthouse], 60.0, "the lighthouse"
        )
        islands = {i: start_island(ns, i, seed, batch, port, run_dir, 0, clock) for i in range(ns.islands)}
        ready = [run_dir / f"ready{i}.{r}" for i in range(ns.islands) for r in range(ns.ranks_per_island)]
        deadline = clock.now() + ns.run_timeout
        wait_for(lambda: all(f.exists() for f in ready), [lighthouse, *islands.values()], ns.run_timeout, "heartbeats")
        for f in ready:  # every rank of every island heartbeats: all go at once
            f.unlink()
        for k, step in enumerate(ns.kill_at if run == "failures" else []):
            i = victim(k, ns.islands)
            logged = functools.partial(logged_iteration, islands[i], step)
            wait_for(logged, [islands[i]], deadline - clock.now(), f"island {i}'s step {step}")
            kill_tree(islands[i])
            events.write(elastic_log.stamp(clock.now(), f"kill island {i} {islands[i].log.name}") + "\n")
            islands[i] = start_island(ns, i, seed, batch, port, run_dir, k + 1, clock)
            events.write(elastic_log.stamp(clock.now(), f"restart island {i} {islands[i].log.name}") + "\n")
            events.flush()
        for job in islands.values():
            job.proc.wait(timeout=max(1.0, deadline - clock.now()))
            job.reader.join(timeout=30)
    finally:
        events.close()
        for job in [*islands.values(), lighthouse]:
            if job.proc.poll() is None:
                kill_tree(job)
    failed = [f"{j.log.name} exit {j.proc.returncode}" for j in islands.values() if j.proc.returncode != 0]
    (run_dir / "status.json").write_text(json.dumps({"status": "; ".join(failed) or "ok"}))
    return run_dir


@dataclass
class Result:
    seed: int
    run: str
    kills: int
    outer_syncs: int
    merged_tokens: int  # every sync's tokens, summed: the job's trained and merged tokens
    partial_syncs: list[int]  # syncs that did not hold every island
    final_island: int  # the island that synced last: the job's model at its end
    final_val: float | None
    island_val: list[float | None]  # each island's final validation loss (its last process's)
    status: str


LIFE = re.compile(r"^(?:island|tb)(\d+)(?:\.(\d+))?(?:\.log)?$")  # island<I>[.k].log, tb<I>[.k]


def last_life(paths: list[Path], island: int) -> Path:
    """The newest process's of island `island` among `paths` (its logs, or its TensorBoard
    directories): the one of its last restart, else of its first start."""
    lives = {}
    for p in paths:
        m = LIFE.match(p.name)
        if m and int(m.group(1)) == island:
            lives[int(m.group(2) or 0)] = p
    return lives[max(lives)]


def final_val(tb: Path) -> float | None:
    """The last validation loss in a TensorBoard directory (None: the process never evaluated)."""
    series = read_run(tb, tb.name).scalars.get(VAL_LOSS)
    return float(series.values[-1]) if series is not None and len(series) else None


def measure(run_dir: Path, seed: int, run: str, islands: int) -> Result:
    """The run's numbers, from its logs and TensorBoard files alone."""
    paths = sorted(run_dir.glob("island*.log"))
    logs = {p.name: elastic_log.read(p) for p in paths}
    found = elastic_log.syncs(logs.values())
    last_sync = []
    for i in range(islands):
        lines = logs[last_life(paths, i).name]
        numbers = [
            int(m.group(2)) for m in (elastic_log.SYNC.search(x.text) for x in lines) if m and int(m.group(1)) == i
        ]
        last_sync.append(max(numbers, default=0))
    tb = sorted(p for p in run_dir.glob("tb*") if p.is_dir())
    vals = [final_val(last_life(tb, i)) for i in range(islands)]
    final = max(range(islands), key=lambda i: (last_sync[i], -i))
    return Result(
        seed,
        run,
        sum(1 for e in elastic_log.events(run_dir / "events.log") if e.kind == "kill"),
        max(found, default=0),
        sum(sum(s.tokens) for s in found.values()),
        [s.number for s in found.values() if len(s.islands) < islands],
        final,
        vals[final],
        vals,
        json.loads((run_dir / "status.json").read_text())["status"],
    )


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def render(results: list[Result], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| seed | run | kills | outer syncs | merged tokens | syncs without every island | final island "
        "| final val loss | each island's | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        partial = ", ".join(map(str, r.partial_syncs)) or "-"
        lines.append(
            f"| {r.seed} | {r.run} | {r.kills} | {r.outer_syncs} | {r.merged_tokens} | {partial} | {r.final_island} | "
            f"{fmt(r.final_val)} | {', '.join(fmt(v) for v in r.island_val)} | {r.status} |"
        )
    steady = {r.seed: r for r in results if r.run == "steady" and r.final_val is not None}
    failures = [r for r in results if r.run == "failures"]
    if steady:
        values = [r.final_val for r in steady.values() if r.final_val is not None]
        low, high = min(values), max(values)
        lines += ["", f"steady, seeds {', '.join(map(str, steady))}: mean {statistics.mean(values):.4f}, "]
        lines[-1] += f"spread {low:.4f} .. {high:.4f}"
        for r in failures:
            own = steady.get(r.seed)
            if r.final_val is None or own is None or own.final_val is None:
                continue
            where = "within" if low <= r.final_val <= high else "below (better than)" if r.final_val < low else "ABOVE"
            tokens = "same tokens" if r.merged_tokens == own.merged_tokens else "OTHER TOKENS than its steady run"
            lines.append(
                f"- failures, seed {r.seed}: {r.final_val:.4f}, {where} the steady seeds' spread; "
                f"{r.final_val - own.final_val:+.4f} against its own seed's steady run ({tokens}; "
                f"{r.outer_syncs} outer syncs against {own.outer_syncs})"
            )
    if any(r.partial_syncs for r in steady.values()):
        lines.append("- warning: a steady run had a sync without every island (a heartbeat missed): not one job")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(args)
    os.chdir(REPO)
    batch, _ = island_run(ns)
    command = shlex.join(["python", "tools/bench_elastic_quality.py", *args])
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    clock, results = Clock(), []
    # a SIGTERM unwinds through the runs' teardown; the caller's handler comes back after
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for seed in ns.seeds:
            for run in RUNS:
                print(f"[seed {seed} {run}] ...", flush=True)
                run_dir = out / f"seed{seed}" / run if ns.report else run_one(ns, seed, run, batch, clock)
                results.append(measure(run_dir, seed, run, ns.islands))
                (run_dir / "result.json").write_text(json.dumps(asdict(results[-1]), indent=1))
                print(f"[seed {seed} {run}] final validation loss {fmt(results[-1].final_val)}", flush=True)
                (out / "quality.md").write_text(render(results, command))
                (out / "quality.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    finally:
        signal.signal(signal.SIGTERM, previous)
    print((out / "quality.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    run_tool(main)
