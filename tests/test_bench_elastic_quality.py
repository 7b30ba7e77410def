"""The elastic quality benchmark (tools/bench_elastic_quality.py): its arguments, its victims,
and its reading of a run (the islands' stamped logs and each process's TensorBoard) into the
job's final validation loss, merged tokens and verdict, on files written here with known numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import load_tool
from torch.utils.tensorboard import SummaryWriter

from benchmarks import elastic_log


def _sync(island: int, n: int, islands: str, tokens: str) -> str:
    return f"outer: island {island}, outer sync {n} at step {4 * n}: islands {islands}, tokens {tokens}, weight 0.5"


def _log(path: Path, lines: list[tuple[float, str]]) -> None:
    path.write_text("".join(elastic_log.stamp(t, text) + "\n" for t, text in lines))


def _val(directory: Path, losses: list[float]) -> None:
    with SummaryWriter(str(directory)) as writer:
        for step, loss in enumerate(losses, start=1):
            writer.add_scalar("val/loss", loss, step)


def test_arguments_and_victims():
    tool = load_tool("bench_elastic_quality", register=True)
    ns = tool.parse_args(["--seeds", "4,5", "--kill-at", "3,9", "--train-iters", "12", "--sync-every", "4"])
    assert (ns.seeds, ns.kill_at, ns.islands, ns.ranks_per_island, ns.extra) == ([4, 5], [3, 9], 3, 2, [])
    for bad in (
        ["--train-iters", "30"],  # not a multiple of H = 20
        ["--kill-at", "250,130"],  # not increasing
        ["--kill-at", "400"],  # not before the end
        ["--seeds", "a"],
        ["--islands", "1"],
    ):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)
    # island 0 is never killed; the others in turn
    assert [tool.victim(k, 3) for k in range(5)] == [1, 2, 1, 2, 1]
    assert [tool.victim(k, 2) for k in range(3)] == [1, 1, 1]


def test_a_run_is_read_from_its_files(tmp_path):
    tool = load_tool("bench_elastic_quality", register=True)
    # 2 islands: island 1 killed after sync 1, restarted; it heals at sync 3 and syncs alone at 4
    # (island 0 finished after sync 3): the job's model is island 1's after sync 4
    _log(tmp_path / "island0.log", [(1.0, _sync(0, 1, "0,1", "64,64")), (2.0, _sync(0, 2, "0", "64"))])
    with (tmp_path / "island0.log").open("a") as f:
        f.write(elastic_log.stamp(3.0, _sync(0, 3, "0,1", "64,0")) + "\n")
    _log(tmp_path / "island1.log", [(1.0, _sync(1, 1, "0,1", "64,64"))])
    _log(tmp_path / "island1.1.log", [(3.0, _sync(1, 3, "0,1", "64,0")), (4.0, _sync(1, 4, "1", "64"))])
    _log(tmp_path / "events.log", [(1.5, "kill island 1 island1.log"), (1.6, "restart island 1 island1.1.log")])
    (tmp_path / "status.json").write_text('{"status": "ok"}')
    _val(tmp_path / "tb0", [6.0, 5.0])
    _val(tmp_path / "tb1", [6.5])  # the killed process's: not the island's final one
    _val(tmp_path / "tb1.1", [6.1, 4.9])
    r = tool.measure(tmp_path, 7, "failures", 2)
    assert (r.seed, r.run, r.kills, r.outer_syncs, r.merged_tokens) == (7, "failures", 1, 4, 128 + 64 + 64 + 64)
    assert (r.partial_syncs, r.final_island, r.status) == ([2, 4], 1, "ok")
    assert r.final_val == pytest.approx(4.9) and r.island_val == [pytest.approx(5.0), pytest.approx(4.9)]
    assert tool.last_life([tmp_path / "tb1", tmp_path / "tb1.1", tmp_path / "tb10"], 1).name == "tb1.1"


def test_the_verdict_against_the_steady_seeds_spread():
    tool = load_tool("bench_elastic_quality", register=True)

    def result(seed: int, run: str, val: float, tokens: int = 1000) -> object:
        return tool.Result(seed, run, 2 if run == "failures" else 0, 20, tokens, [], 0, val, [val], "ok")

    results = [
        result(1, "steady", 4.00),
        result(1, "failures", 4.01),
        result(2, "steady", 4.05),
        result(2, "failures", 4.10, tokens=999),
        result(3, "steady", 3.98),
        result(3, "failures", 3.90),
    ]
    text = tool.render(results, "python tools/bench_elastic_quality.py")
    assert "| 1 | failures | 2 | 20 | 1000 | - | 0 | 4.0100 | 4.0100 | ok |" in text
    assert "steady, seeds 1, 2, 3: mean 4.0100, spread 3.9800 .. 4.0500" in text
    assert "- failures, seed 1: 4.0100, within the steady seeds' spread; +0.0100 against its own" in text
    assert "- failures, seed 2: 4.1000, ABOVE the steady seeds' spread; +0.0500 against its own seed" in text
    assert "(OTHER TOKENS than its steady run; 20 outer syncs against 20)" in text
    assert "- failures, seed 3: 3.9000, below (better than) the steady seeds' spread; -0.0800 against" in text
