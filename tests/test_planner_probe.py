"""The planner's probes on 4 gloo ranks (2 virtual nodes x 2), and the calibration tool end to end.

The probes feed `paro_strategy: auto` and tools/calibrate_planner.py. A real timing on a shared
2-core machine is noise, so what the probes compute from timings is checked against a known
truth instead: the probes' clock (`probe.time`) is replaced by one that advances by a chosen
cost exactly when the timed operation runs (the real collective or AdamW step still runs), and
the probes must report that cost per call, the fitted link parameters, and the AdamW rate. Of a
real run the exact parts are asserted: every op on every group that has peers, and the bytes
each point is read at (the comm counter's convention).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import load_tool

from megazpp.launch.local_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
SIZES = (1 << 8, 1 << 12, 1 << 18)  # fp32 elements per member
# seconds per call of each op at SIZES on a group of 2 (twice that on 4); all_reduce's largest
# size dips below the one before, as noise does, and the probe raises it to the previous time
FAKE_COST = {"all_gather": (1e-3, 2e-3, 5e-3), "reduce_scatter": (2e-3, 3e-3, 9e-3), "all_reduce": (4e-3, 6e-3, 5e-3)}
RAISED = {**FAKE_COST, "all_reduce": (4e-3, 6e-3, 6e-3)}
LINK_LATENCY, LINK_BW = 50e-6, 2e9  # seconds per ring step, bytes/s one rank receives
ADAM_RATE = 3e7  # elements per second
# the fake clock's times are sums of the costs: float64 rounding leaves them within ~1e-15
# relative, the fits add a handful of operations; 1e-9 is far above that and far below any
# slip (a unit, a factor of the ring, the wrong call or size)
REL = 1e-9


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0  # near 0, float64 differences of the sums stay exact to ~1e-16 s

    def perf_counter(self) -> float:
        return self.now


def _faked(probe, clock: _Clock) -> dict:
    """The probes' results on `clock`, which only the stood-in costs advance."""
    from megazpp.parallel import comm
    from megazpp.parallel.topology import Topology

    topo = Topology.from_env(ranks_per_node=2)
    real = (probe._calls, probe.build_adamw, probe.time, probe.comm)
    real_calls, real_adamw = real[:2]

    def costed_calls(op: str, numel: int, size: int, group, device):
        call = real_calls(op, numel, size, group, device)

        def run() -> None:
            call()
            clock.now += FAKE_COST[op][SIZES.index(numel)] * size / 2

        return run

    def costed_all_reduce(t: torch.Tensor, *, group, tag: str) -> None:
        comm.all_reduce(t, group=group, tag=tag)
        g = comm.group_size(group)
        clock.now += 2 * (g - 1) * LINK_LATENCY + 2 * (g - 1) / g * 4 * t.numel() / LINK_BW

    def costed_adamw(groups, config):
        optimizer = real_adamw(groups, config)
        numel, step = sum(p.numel() for g in groups for p in g["params"]), optimizer.step

        def timed_step() -> None:
            step()
            clock.now += numel / ADAM_RATE

        optimizer.step = timed_step
        return optimizer

    probe.time = SimpleNamespace(perf_counter=clock.perf_counter)
    probe._calls, probe.build_adamw = costed_calls, costed_adamw
    try:
        groups = {**probe.dp_groups(topo), "hpz": (None, 1)}
        out = {
            "fits": probe.probe_collectives(groups, sizes=SIZES, repeats=2, device=probe.HOST),
            "adam": probe.probe_optimizer_rate(1 << 12, 2, device=probe.HOST),
        }
        # probe_link times comm.all_reduce itself (the probe's only use of it outside _calls)
        probe.comm = SimpleNamespace(all_reduce=costed_all_reduce, barrier=comm.barrier)
        out["links"] = {
            "dp": probe.probe_link(topo.dp_group, topo.dp, repeats=1, device=probe.HOST),
            "cross": probe.probe_link(topo.dp_inter_group, 2, repeats=1, device=probe.HOST),
        }
        return out
    finally:
        probe._calls, probe.build_adamw, probe.time, probe.comm = real


def _probe_rank() -> dict:
    torch.set_num_threads(1)
    from megazpp.parallel.topology import Topology
    from megazpp.planner import probe

    topo = Topology.from_env(ranks_per_node=2)
    groups = {**probe.dp_groups(topo), "hpz": (None, 1)}  # hpZ off: a group of one
    fits = probe.probe_collectives(groups, sizes=SIZES, repeats=1, device=probe.HOST)
    received = probe._recorded(probe._calls("all_gather", 1 << 12, topo.dp, topo.dp_group, probe.HOST))
    scatter = probe._recorded(probe._calls("reduce_scatter", 1 << 12, topo.dp, topo.dp_group, probe.HOST))
    return {"fits": fits, "check": (received, scatter), "fake": _faked(probe, _Clock())}


def test_collective_probe_fits_every_op_and_group():
    result = run_ranks(_probe_rank, 4, env={"LOCAL_WORLD_SIZE": "2"})[0]
    fits = result["fits"]
    assert sorted(fits) == sorted(
        f"{op}/{g}" for op in ("all_gather", "reduce_scatter", "all_reduce") for g in ("dp", "intra", "cross")
    )  # hpz has no peer: not probed
    for points in fits.values():
        assert all(math.isfinite(t) and t > 0 for _, t in points)
    received, scatter = result["check"]
    assert received == 4 * (1 << 12) * 3  # fp32, a gloo ring of 4: each hop carries 3 chunks
    assert scatter == 2 * received  # gloo's reduce-scatter is the ring all-reduce of the whole buffer
    assert fits["all_gather/dp"][1][0] == received

    fake = result["fake"]
    assert sorted(fake["fits"]) == sorted(fits)
    for key, points in fake["fits"].items():
        op, group = key.split("/")
        size = 4 if group == "dp" else 2
        # each point: the bytes the counter records for one call of that size (the real run's),
        # and the seconds ONE call of that op and size costs, a dip raised to the time before
        assert [b for b, _ in points] == [b for b, _ in fits[key]], key
        assert [t for _, t in points] == pytest.approx([c * size / 2 for c in RAISED[op]], rel=REL), key
    for link in fake["links"].values():  # the fit is exact for times on its own model
        assert link.bandwidth == pytest.approx(LINK_BW, rel=REL)
        assert link.latency == pytest.approx(LINK_LATENCY, rel=REL)
    assert fake["adam"] == pytest.approx(ADAM_RATE, rel=REL)


def _verdict(report: str) -> tuple[float, float, str]:
    """(Spearman, largest error %, PASS / FAIL) of the tool's report; a missing line fails."""
    found = re.search(
        r"Spearman rank correlation (\S+) \(target >= 0.8\); largest error ([0-9.]+) % "
        r"\(target <= 30 %\): (PASS|FAIL)$",
        report,
        re.M,
    )
    assert found, report
    return float(found[1]), float(found[2]), found[3]


def test_calibration_rank_correlation_on_fixed_timings():
    """The report's accuracy numbers from fixed predicted and measured times, whose values are
    known: Spearman over n untied items is 1 - 6 sum(d^2) / (n (n^2 - 1)), with ties averaged."""
    tool = load_tool("calibrate_planner")
    assert tool.spearman([1, 2, 3, 4, 5], [1, 2, 3, 5, 4]) == pytest.approx(1 - 6 * 2 / (5 * 24))
    assert tool.spearman([1, 2, 3, 4, 5], [2, 1, 3, 5, 4]) == pytest.approx(1 - 6 * 4 / (5 * 24))
    assert tool.spearman([3, 2, 1], [1, 2, 3]) == pytest.approx(-1.0)
    assert tool.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # ranks 0.5 0.5 2
    assert math.isnan(tool.spearman([1, 2, 3], [2, 2, 2]))  # no ranking to correlate with

    from megazpp.planner.cluster import Cluster

    cluster = Cluster(
        nodes=2,
        gpus_per_node=2,
        memory_bytes=1e12,
        flops=1e10,
        intra_bw=1e9,
        inter_bw=1e8,
        memory_bw=1e10,
        backend="gloo",
        overlap=False,
        optimizer_rate=1e7,
    )
    a = SimpleNamespace(
        num_layers=2,
        hidden_size=32,
        seq_length=32,
        vocab_size=256,
        micro_batch_size=1,
        micro_batches=2,
        inter_gbit=None,
        breakdown=False,
    )

    def report(predicted: list[float], measured: list[float]) -> str:
        rows = [(f"S{i}", p, m, {}) for i, (p, m) in enumerate(zip(predicted, measured))]
        return tool.report({"rows": rows, "cluster": cluster, "probed_inter": 1e8}, a)

    # 5 strategies, one pair of neighbours swapped: 0.9; largest error 4 / 4.95 - 1
    assert _verdict(report([1.0, 2.0, 3.0, 4.0, 5.0], [1.05, 2.1, 3.0, 4.95, 4.6])) == (0.9, 19.2, "PASS")
    # two pairs swapped: 0.8, the target itself, passes; with 1 / 2.1 - 1 it fails on the error
    assert _verdict(report([1.0, 1.2, 3.0, 4.0, 4.4], [1.15, 1.05, 3.0, 4.3, 4.1])) == (0.8, 14.3, "PASS")
    assert _verdict(report([1.0, 2.0, 3.0, 4.0, 5.0], [2.1, 2.0, 3.0, 4.95, 3.7])) == (0.8, 52.4, "FAIL")
    # measured times all equal: no rank correlation, which must not pass (every error is small)
    rho, worst, verdict = _verdict(report([2.0, 2.1, 2.2], [2.1, 2.1, 2.1]))
    assert math.isnan(rho) and worst == 4.8 and verdict == "FAIL"


@pytest.mark.slow
def test_calibration_tool_runs_locally():
    proc = subprocess.run(
        [
            sys.executable,
            "tools/calibrate_planner.py",
            "--local",
            "--hidden-size",
            "32",
            "--num-layers",
            "2",
            "--steps",
            "2",
            "--vocab-size",
            "256",
            "--seq-length",
            "32",
            "--strategies",
            "NNN",
            "GGG",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\| (NNN|GGG) \| ([0-9.]+) \| ([0-9.]+) \| ([-+][0-9.]+) % \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["NNN", "GGG"]
    for _, predicted, measured, error in rows:
        assert float(predicted) > 0 and float(measured) > 0
        assert abs(float(error) - 100 * (float(predicted) / float(measured) - 1)) < 1.0  # 4-digit rounding
    assert "collectives (ms per call at 4 KiB / 256 KiB / 4 MiB per member): all_gather/cross" in proc.stdout
    # the accuracy line is what the printed rows make it: two strategies rank the same way (1)
    # or the other way (-1), never nan (two timings or predictions tied to the last digit of a
    # float); the largest error is the larger printed one; the verdict follows from both
    rho, worst, verdict = _verdict(proc.stdout)
    (_, p1, m1, e1), (_, p2, m2, e2) = rows
    assert rho == (1.0 if (float(p1) - float(p2)) * (float(m1) - float(m2)) > 0 else -1.0)
    assert worst == pytest.approx(max(abs(float(e1)), abs(float(e2))), abs=0.1)
    assert verdict == ("PASS" if rho >= 0.8 and worst <= 30 else "FAIL")
