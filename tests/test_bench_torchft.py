"""The torchft peer end to end on the loopback: torchft's DiLoCo over 2 replica groups x 2 CPU
ranks (FSDP2 inside) against megazpp's DiLoCo (ZeRO-3 inside each node) on the same tiny model,
data and outer settings, both launched by tools/bench_netlab.py as the benchmark launches them.

Skipped where torchft is not installed (the optional `torchft` extra); the row's command lines
and the peer's refusals are tested without it in test_bench_netlab.py.
"""

from __future__ import annotations

import importlib.util
import json
import signal

import pytest
from support import load_tool

from megazpp.analysis.event_reader import read_run

if importlib.util.find_spec("torchft") is None:
    pytest.skip(
        "torchft is not installed in this python (a core dependency: pip install -e .); the torchft peer cannot run",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-attention-heads", "4", "--num-query-groups", "2"]


def test_torchft_diloco_matches_megazpp_diloco(tmp_path, run_sh_data_dir, monkeypatch):
    """20 steps with an outer step every 5 (the `--` flags reach every run, after the rows' own
    H = 20), fp32 outer gradients on both sides (torchft's only wire on CPU): the same start,
    samples, inner AdamW steps and Nesterov outer steps, so the logged losses (the mean over all
    4 ranks) agree step by step. Not bitwise: the engines sum gradients in different orders
    (megazpp's ZeRO-3 buckets against FSDP2's per-layer reduce-scatter), each fp32 sum
    differing in the last bits (relative ~1e-7); 20 steps of AdamW and 4 outer steps amplify
    that, measured at most 1e-6 on losses near 7, so 1e-4 leaves two orders of margin while
    a wrong sample, schedule, outer lr or momentum moves the losses by 1e-3 or more."""
    out = tmp_path / "bench"
    monkeypatch.chdir(load_tool("bench_netlab").REPO)  # main() moves into the checkout; restored after the test
    own = signal.getsignal(signal.SIGTERM)
    assert (
        load_tool("bench_netlab").main(
            [
                "--rates",
                "loopback",
                "--only",
                "diloco-h20-bf16,torchft-diloco-h20",
                "--steps",
                "20",
                "--warmup",
                "0",
                "--data-dir",
                str(run_sh_data_dir),
                "--out",
                str(out),
                "--timeout",
                "600",
                "--port",
                "29950",
                "--",
                *TINY,
                "--outer-sync-every",
                "5",
                "--outer-quantize",
                "none",
            ]
        )
        == 0
    )
    # its SIGTERM handler (the netlab teardown's) was the tool's only: a pool forked later in this
    # process would inherit it (a preprocessing pool's workers then outlived its terminate)
    assert signal.getsignal(signal.SIGTERM) is own
    rows = {r["config"]: r for r in json.loads((out / "loopback.json").read_text())["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok", "ok"], rows
    peer = rows["torchft-diloco-h20"]
    assert peer["runner"] == "torchft" and len(peer["rss_per_rank"]) == 4  # every rank's probe, none overwritten
    last = [
        line
        for line in (out / "loopback" / "torchft-diloco-h20" / "node0.log").read_text().splitlines()
        if line.startswith("iter     20/20")
    ]
    assert len(last) == 1 and last[0].endswith("| outer steps 4")  # torchft committed every outer step
    losses = {name: read_run(str(out / "loopback" / name / "tb"), name).scalars["train/loss"].values for name in rows}
    ours, theirs = losses["diloco-h20-bf16"], losses["torchft-diloco-h20"]
    assert len(ours) == len(theirs) == 20
    assert abs(ours - theirs).max() < 1e-4, (ours, theirs)
    assert ours[-1] < ours[0] - 0.1  # it trained
