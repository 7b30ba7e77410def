"""The elastic failure benchmark (tools/bench_elastic.py): its log reading on logs written here
with known numbers, and the tool itself on netlab at a tiny scale (seconds), whose every number
is recomputed from the logs it left (each island's stamped output, its kills and restarts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, load_tool

from benchmarks import elastic_log
from megazpp.errors import DataError
from tests.test_first_hour import TINY


def _write(path: Path, lines: list[tuple[float, str]]) -> None:
    path.write_text("".join(elastic_log.stamp(t, text) + "\n" for t, text in lines) + "a line cut by a kill")


def _sync(island: int, n: int, islands: str, tokens: str) -> str:
    return f"outer: island {island}, outer sync {n} at step {4 * n}: islands {islands}, tokens {tokens}, weight 0.5"


def test_elastic_numbers_from_logs(tmp_path):
    # island 2 killed at 10.0, dropped at sync 3 (12.5), restarted at 10.1, healed at sync 5 (20.0)
    _write(
        tmp_path / "island0.log",
        [(5.0, _sync(0, 1, "0,1,2", "128,128,128")), (8.0, _sync(0, 2, "0,1,2", "128,128,128"))]
        + [(12.5, "outer: island 2 dropped at outer sync 3 (absent from the quorum: ...)")]
        + [(12.5, _sync(0, 3, "0,1", "128,128")), (16.0, _sync(0, 4, "0,1", "128,128"))]
        + [(20.0, _sync(0, 5, "0,1,2", "128,128,0")), (24.0, _sync(0, 6, "0,1,2", "128,128,128"))],
    )
    _write(tmp_path / "island1.log", [(4.9, _sync(1, 1, "0,1,2", "128,128,128"))])
    _write(tmp_path / "island2.log", [(5.1, _sync(2, 1, "0,1,2", "128,128,128"))])
    _write(
        tmp_path / "island2.1.log",
        [(19.9, "outer: island 2 rejoined at outer sync 5 with island 0's live state (...)")],
    )
    _write(tmp_path / "events.log", [(10.0, "kill island 2 island2.log"), (10.1, "restart island 2 island2.1.log")])
    logs = {p.name: elastic_log.read(p) for p in sorted(tmp_path.glob("island*.log"))}
    found = elastic_log.syncs(logs.values())
    assert [(s.number, s.t) for s in found.values()] == [(1, 4.9), (2, 8.0), (3, 12.5), (4, 16.0), (5, 20.0), (6, 24.0)]
    # syncs 2..5 in (4.9, 20.0]: 3 + 2 + 2 + 2 island-intervals of 4 steps (the healed one weighs 0)
    assert elastic_log.merged_steps(found, 4.9, 20.0, tokens_per_step=32) == (3 + 2 + 2 + 2) * 4
    kill, restart = elastic_log.events(tmp_path / "events.log")
    assert (kill.kind, kill.island, kill.log, restart.log) == ("kill", 2, "island2.log", "island2.1.log")
    assert elastic_log.detect_times([kill], logs, end=30.0) == [pytest.approx(2.5)]
    assert elastic_log.detect_times([kill], logs, end=12.0) == [None]
    assert elastic_log.rejoin_times([restart], logs, end=30.0) == [pytest.approx(9.8)]
    _write(tmp_path / "island1.log", [(4.9, _sync(1, 1, "0,1", "128,128"))])
    with pytest.raises(DataError, match="outer sync 1 is logged with islands"):
        elastic_log.syncs(elastic_log.read(p) for p in tmp_path.glob("island*.log"))
    (tmp_path / "events.log").write_text(elastic_log.stamp(1.0, "stop island 2") + "\n")
    with pytest.raises(DataError, match="unexpected line 'stop island 2'"):
        elastic_log.events(tmp_path / "events.log")


def test_synchronous_numbers_from_logs(tmp_path):
    # H = 4: syncs at steps 4, 8 (by 9.0); killed at 10.0 after step 10; resumed from step 8, past 8 at 31.0
    steps = [(1.0 * s, s) for s in range(1, 11)] + [(29.0, 9), (30.0, 10), (30.5, 11), (31.0, 12)]
    _write(tmp_path / "island0.log", [(t, f"iter {s:6d}/1000 | loss 5.0 | lr 1e-3") for t, s in steps])
    at_syncs = elastic_log.sync_steps(elastic_log.read(tmp_path / "island0.log"), 4)
    assert at_syncs == [(4.0, 4), (8.0, 8), (31.0, 12)]
    assert (elastic_log.reached(at_syncs, 3.9), elastic_log.reached(at_syncs, 30.0)) == (0, 8)
    # trained in (3.5, 30.0]: steps 4..10, then 9 and 10 again (redone after the restart)
    assert elastic_log.trained_steps(elastic_log.read(tmp_path / "island0.log"), 3.5, 30.0) == 9
    kill = elastic_log.Event(10.0, "kill", 1, "island1.log")
    assert elastic_log.back_times([kill], at_syncs, end=40.0) == [21.0]
    assert elastic_log.back_times([kill], at_syncs, end=30.0) == [None]


def test_arguments_and_table():
    tool = load_tool("bench_elastic", register=True)  # its dataclasses look their module up
    ns = tool.parse_args(["--kill-every", "60", "--runs", "elastic-failures", "--", "--hidden-size", "64"])
    assert (ns.kill_every, ns.runs, ns.extra, ns.save_interval) == (
        60.0,
        ["elastic-failures"],
        ["--hidden-size", "64"],
        20,
    )
    default = tool.parse_args([])
    assert (default.islands, default.sync_every, default.kill_every, default.rate) == (3, 20, 300.0, "1gbit")
    for bad in (["--runs", "elastic"], ["--islands", "1"], ["--kill-every", "0"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)
    results = [
        tool.Result("elastic-steady", 0, 100.0, 1000.0, 10.0, 1000, [], [], [], 2.0, "ok"),
        tool.Result("elastic-failures", 1, 100.0, 950.0, 9.5, 1000, [5.5], [None], [], 2.0, "ok"),
        tool.Result("sync-steady", 0, 100.0, 800.0, 8.0, 800, [], [], [], 2.0, "ok"),
        tool.Result("sync-failures", 1, 100.0, 600.0, 6.0, 750, [], [], [40.25], 3.25, "ok"),
    ]
    started = {"command": "python tools/bench_elastic.py", "load": "1.00, 2.00, 3.00"}
    table = tool.render(results, started, "python tools/bench_elastic.py").splitlines()
    assert table[0] == "`python tools/bench_elastic.py`"
    assert "| elastic-failures | 1 | 100 | 950 | 9.50 | 95.0% | 95.0% | 95.0% | 5.5 | n/a | - | 2.0 | ok |" in table
    assert "| sync-failures | 1 | 100 | 600 | 6.00 | 75.0% | 60.0% | 80.0% | - | - | 40.2 | 3.2 | ok |" in table
    again = tool.render(results, started, "python tools/bench_elastic.py --report")
    assert again.startswith("`python tools/bench_elastic.py` (measured again from its logs by `python tools/bench")


def _upto(at: list[tuple[float, int]], when: float) -> int:
    return max((step for t, step in at if t <= when), default=0)


def _windowed(found: list[tuple[float, str]], begin: float, end: float) -> list[str]:
    return [tokens for t, tokens in found if begin < t <= end]


@pytest.mark.netlab
@pytest.mark.slow
def test_the_benchmark_numbers_are_its_logs(run_sh_data_dir, tmp_path):
    """Both failure runs, 3 islands of one rank, H = 4, one kill 20 s into a 40 s window: every
    number of result.json recomputed here from the logs with this test's own reading."""
    out, h, seq = tmp_path / "out", 4, 32
    env = {**os.environ, "NETLAB_PREFIX": f"mzb{os.getpid() % 10000}", "NETLAB_SUBNET": f"10.82.{os.getpid() % 250}"}
    command = [sys.executable, "tools/bench_elastic.py", "--runs", "elastic-failures,sync-failures"]
    command += ["--ranks-per-island", "1", "--sync-every", str(h), "--kill-every", "20", "--duration", "40"]
    command += ["--heartbeat-timeout-ms", "1500", "--train-iters", "4000", "--data-dir", str(run_sh_data_dir)]
    command += ["--out", str(out), "--", *TINY, "--seq-length", str(seq)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"mzb{os.getpid() % 10000}" not in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    tokens_per_step = 4 * seq  # the tiny model's global batch 4 per island
    for run in ("elastic-failures", "sync-failures"):
        run_dir = out / run
        result = json.loads((run_dir / "result.json").read_text())
        window = json.loads((run_dir / "window.json").read_text())
        begin, end = window["begin"], window["end"]
        assert result["window_s"] == pytest.approx(end - begin) == pytest.approx(40.0)
        stamped = {p.name: p.read_text() for p in run_dir.glob("island*.log")}
        lines = {name: re.findall(r"^\[\s*([\d.]+)\] (.*)$", text, flags=re.M) for name, text in stamped.items()}
        events = re.findall(
            r"^\[\s*([\d.]+)\] (kill|restart) island (\d) (\S+)$", (run_dir / "events.log").read_text(), re.M
        )
        # one kill, 20 s in, island 1, restarted at once into a log of its own
        assert [(e[1], e[2]) for e in events] == [("kill", "1"), ("restart", "1")] and result["kills"] == 1
        assert float(events[0][0]) == pytest.approx(begin + 20, abs=5.0) and events[1][3] == "island1.1.log"
        kill_t, restart_t = float(events[0][0]), float(events[1][0])
        if run == "elastic-failures":
            syncs = {}
            for found in lines.values():
                for t, text in found:
                    m = re.search(r"outer sync (\d+) at step \d+: islands (\d+(?:,\d+)*), tokens (\d+(?:,\d+)*)", text)
                    if m:
                        syncs.setdefault(int(m.group(1)), []).append((float(t), m.group(3)))
            first = {n: min(seen) for n, seen in syncs.items()}
            assert begin == min(t for t, _ in first.values())  # the window starts at sync 1
            merged = sum(sum(map(int, tok.split(","))) for tok in _windowed(list(first.values()), begin, end))
            assert result["useful_steps"] == pytest.approx(merged / tokens_per_step)
            drops = [
                float(t)
                for name, found in lines.items()
                if name != "island1.log"
                for t, text in found
                if "outer: island 1 dropped at outer sync" in text and float(t) > kill_t
            ]
            assert result["detect_s"] == [pytest.approx(min(drops) - kill_t)] and min(drops) <= end
            rejoined = [
                float(t) for t, text in lines["island1.1.log"] if "outer: island 1 rejoined at outer sync" in text
            ]
            expected = rejoined[0] - restart_t if rejoined and rejoined[0] <= end else None
            assert result["rejoin_s"] == [expected if expected is None else pytest.approx(expected)]
        else:
            at = [
                (float(t), int(m.group(1)))
                for t, text in lines["island0.log"]
                if (m := re.match(r"\s*iter\s+(\d+)/\d+ \| loss ", text)) and int(m.group(1)) % h == 0
            ]
            assert result["useful_steps"] == 3 * (_upto(at, end) - _upto(at, begin)) > 0
            past = [t for t, s in at if t > kill_t and s > _upto(at, kill_t) and t <= end]
            assert result["back_s"] == [pytest.approx(min(past) - kill_t) if past else None]
        iterations = {
            name: sum(
                1 for t, text in found if begin < float(t) <= end and re.match(r"\s*iter\s+\d+/\d+ \| loss ", text)
            )
            for name, found in lines.items()
        }  # the synchronous job's lines are node 0's, one per step of all 3 islands
        trained = sum(iterations.values()) if run == "elastic-failures" else 3 * iterations["island0.log"]
        assert result["trained_steps"] == trained >= result["useful_steps"]
        assert result["steps_per_s"] == pytest.approx(result["useful_steps"] / 40.0)
        assert result["status"] == "ok"  # no process ended by itself
        print(run, result)
    table = (out / "elastic.md").read_text()
    assert "| elastic-failures | 1 | 40 |" in table and "| sync-failures | 1 | 40 |" in table
