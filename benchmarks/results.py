"""One benchmark row per configuration, from what its run left behind; the table of a setting.

A row is assembled only from files the run wrote: the logging rank's TensorBoard scalars
(`train/loss`, `perf/tokens_per_sec`, one point per step), every rank's counted bytes
(`comm_rank<R>.json`, MEGAZPP_COMM_REPORT_DIR) and peak RSS (`rss_rank<R>.json`, the rank
probe), plus the kernel's byte counters of the inter-node links read around the run. Nothing
is estimated: a number a run did not produce is None and prints as "n/a".

Per-step numbers:
* step time = median over the steps after the first `warmup` (default 1) of tokens_per_step /
  tokens_per_sec (for two-level rows the mean: their outer syncs fall on one step in H) (the
  first steps pay for one-time work: first gathers, recorded execution order,
  allocator growth, and with compiled CPU quantizers one compilation per new shape);
  with no step left: the last one;
* counted inter-node bytes per step = sum over ranks of each rank's received inter-node
  bytes for the whole run / steps (the trainer moves no bytes outside steps when evaluation
  and checkpoints are off, as in the benchmark's YAML), less the planner's start-up probe
  (`PROBE_TAG`, with `--planner-probe`);
* wire bytes per step = bytes received by all nodes' inter-node links / steps, i.e. including
  rendezvous, process-group set-up and TCP/IP overhead, amortised over the run;
* collective calls per step = per rank, the median over the steps after the first `warmup`
  of the torch.distributed calls made between two optimizer steps (the rank probe's
  `calls_at_steps`, the same count for megazpp and DeepSpeed); the row shows the largest rank's.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from megazpp.analysis.event_reader import read_run
from megazpp.errors import DataError
from megazpp.parallel.counter import write_json_atomic
from megazpp.unique_keys import JSONObject

REFERENCE = "zero3"

PROBE_TAG = "planner/probe"  # the counter's tag of the planner's start-up measurements


@dataclass
class Row:
    config: str
    runner: str
    status: str  # "ok" or "failed: <reason>"
    steps: int
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    counted_inter_bytes_per_step: float | None = None
    wire_inter_bytes_per_step: float | None = None
    peak_rss_bytes: int | None = None
    rss_per_rank: list[int] = field(default_factory=list)
    calls_per_step: float | None = None
    calls_per_rank: list[float] = field(default_factory=list)
    final_loss: float | None = None
    wall_s: float | None = None


def step_time(tokens_per_sec: Sequence[float], tokens_per_step: int, warmup: int = 1, amortised: bool = False) -> float:
    """The median step after `warmup`; with `amortised` (two-level rows, whose outer syncs fall
    on one step in H) the mean, so the syncs' time is spread over the steps as their bytes are."""
    times = [tokens_per_step / v for v in tokens_per_sec if v > 0 and math.isfinite(v)]
    if not times:
        raise DataError("no finite positive perf/tokens_per_sec point: the run logged no step")
    kept = times[warmup:] if len(times) > warmup else times[-1:]
    return statistics.mean(kept) if amortised else statistics.median(kept)


def calls_per_step(calls_at_steps: Sequence[int], warmup: int = 1) -> float | None:
    """Median calls of one step after `warmup` steps (the first step also holds the set-up)."""
    per_step = [b - a for a, b in zip([0, *calls_at_steps], calls_at_steps)]
    if not per_step:
        return None
    return float(statistics.median(per_step[warmup:] if len(per_step) > warmup else per_step[-1:]))


def _read_json_files(pattern: str) -> list[JSONObject]:
    found = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            found.append(json.load(f))
    return found


def collect_row(
    name: str,
    runner: str,
    run_dir: str,
    *,
    steps: int,
    tokens_per_step: int,
    world_size: int,
    wire_bytes: int | None,
    wall_s: float,
    failure: str | None = None,
    warmup: int = 1,
    amortised: bool = False,
) -> Row:
    """The row of one finished (or failed) run whose files are under `run_dir`."""
    row = Row(name, runner, "ok" if failure is None else f"failed: {failure}", steps, wall_s=wall_s)
    if failure is not None:
        return row
    run = read_run(os.path.join(run_dir, "tb"), name)
    if "perf/tokens_per_sec" not in run.scalars or "train/loss" not in run.scalars:
        raise DataError(f"{run_dir}/tb: no train/loss or perf/tokens_per_sec scalars")
    row.step_time_s = step_time(run.scalars["perf/tokens_per_sec"].values.tolist(), tokens_per_step, warmup, amortised)
    row.tokens_per_s = tokens_per_step / row.step_time_s
    row.final_loss = float(run.scalars["train/loss"].values[-1])
    comm = _read_json_files(os.path.join(run_dir, "comm_rank*.json"))
    if runner == "megazpp":
        if len(comm) != world_size:
            raise DataError(f"{run_dir}: {len(comm)} comm_rank*.json reports for {world_size} ranks")
        probe = [r["run"].get("tags", {}).get(PROBE_TAG, {}).get("inter", 0) for r in comm]
        row.counted_inter_bytes_per_step = (sum(r["run"]["inter"] for r in comm) - sum(probe)) / steps
    rss = _read_json_files(os.path.join(run_dir, "rss_rank*.json"))
    if len(rss) != world_size:
        raise DataError(f"{run_dir}: {len(rss)} rss_rank*.json probes for {world_size} ranks")
    probes = sorted(rss, key=lambda r: r["rank"])
    row.rss_per_rank = [int(r["maxrss_bytes"]) for r in probes]
    row.peak_rss_bytes = max(row.rss_per_rank)
    calls = [calls_per_step(r.get("calls_at_steps", []), warmup) for r in probes]
    if all(c is not None for c in calls):
        row.calls_per_rank = [float(c) for c in calls if c is not None]
        row.calls_per_step = max(row.calls_per_rank)
    if wire_bytes is not None:
        row.wire_inter_bytes_per_step = wire_bytes / steps
    return row


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value / scale:.{digits}f}"


def render_markdown(setting: str, rows: Sequence[Row], command: str) -> str:
    """The table of one link setting; speed-up is tokens/s over this setting's zero3 row."""
    ref = next((r.tokens_per_s for r in rows if r.config == REFERENCE and r.tokens_per_s), None)
    lines = [
        f"## {setting}",
        "",
        f"Command: `{command}`",
        "",
        "| config | runner | step time (s) | tokens/s | vs zero3 | inter-node MB/step counted "
        "| inter-node MB/step on the wire | wire / counted | calls/step (max rank) "
        "| peak RSS MiB per rank | final loss | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = r.tokens_per_s / ref if ref and r.tokens_per_s else None
        ratio = (
            r.wire_inter_bytes_per_step / r.counted_inter_bytes_per_step
            if r.wire_inter_bytes_per_step and r.counted_inter_bytes_per_step
            else None
        )
        lines.append(
            f"| {r.config} | {r.runner} | {fmt(r.step_time_s, digits=3)} | {fmt(r.tokens_per_s, digits=0)} "
            f"| {fmt(speedup)} | {fmt(r.counted_inter_bytes_per_step, 1e6)} "
            f"| {fmt(r.wire_inter_bytes_per_step, 1e6)} | {fmt(ratio)} "
            f"| {fmt(r.calls_per_step, digits=0)} | {_per_rank_mib(r)} | {fmt(r.final_loss, digits=4)} "
            f"| {r.status.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def _per_rank_mib(r: Row) -> str:
    """Every rank's peak RSS in MiB, '/'-separated (the max alone when only it is known)."""
    if r.rss_per_rank:
        return " / ".join(f"{v / 2**20:.0f}" for v in r.rss_per_rank)
    return fmt(r.peak_rss_bytes, 2**20, 0)


def write_setting(out_dir: str, setting: str, rows: Sequence[Row], command: str) -> tuple[str, str]:
    """Write `<setting>.md` and `<setting>.json` (temporary name, then rename)."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, f"{setting}.md"), os.path.join(out_dir, f"{setting}.json")
    tmp = f"{md}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(render_markdown(setting, rows, command))
    os.replace(tmp, md)
    write_json_atomic(js, {"setting": setting, "command": command, "rows": [asdict(r) for r in rows]})
    return md, js
