"""Two-level training as a user runs it: `run.sh` on 4 ranks carved into 2 nodes of 2 (two
islands), saving and logging; the banner, the outer syncs in the log and in TensorBoard, a
resume, the export of the synced parameters; and a refusal in one line before any rank starts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megazpp.analysis.event_reader import read_run
from megazpp.checkpoint.reader import CheckpointReader
from tests.test_first_hour import one_line_refusal, run_sh, tool

OUTER = ["--micro-batch-size", "4", "--ranks-per-node", "2", "--outer-algorithm", "diloco", "--outer-sync-every", "5"]


@pytest.mark.slow
def test_run_sh_two_level_trains_saves_resumes_and_exports(run_sh_data_dir, tmp_path):
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    proc = run_sh(
        run_sh_data_dir,
        *OUTER,
        "--train-iters",
        "12",
        "--save",
        str(save),
        "--tensorboard-dir",
        str(tb),
        "--log-interval",
        "1",
        nproc=4,
    )
    out = proc.stdout + proc.stderr
    assert "two-level: 2 islands of 1 node(s), 2 DP rank(s) each" in out and "DiLoCo every 5 inner steps" in out
    synced = [line for line in out.splitlines() if "outer/pseudo_grad_norm" in line]
    assert len(synced) == 2 and "iter      5" in synced[0] and "iter     10" in synced[1], synced
    scalars = read_run(tb, "two-level").scalars
    assert list(scalars["outer/inter_bytes"].steps) == [5, 10]
    assert all(v > 0 for v in scalars["outer/island_divergence"].values)
    assert (save / "latest").read_text().strip().endswith("12")

    resumed = run_sh(run_sh_data_dir, *OUTER, "--train-iters", "16", "--save", str(save), "--load", str(save), nproc=4)
    assert "resumed from" in resumed.stdout + resumed.stderr and "iter     15" in resumed.stdout + resumed.stderr

    out_file = tmp_path / "model.safetensors"
    export = tool("tools/export_checkpoint.py", "--load", str(save), "--out", str(out_file))
    assert "averaged parameters at the last outer sync (iteration 15" in export.stdout
    weights = load_file(str(out_file))
    # the export is the outer snapshot (the same on both islands), not island 0's own masters
    reader = CheckpointReader(save)
    engines = [reader.rank_state(0, 0, dp_rank)["engine"] for dp_rank in (0, 2)]  # rank 0 of each island
    assert torch.equal(engines[0]["outer"]["snapshot"], engines[1]["outer"]["snapshot"])
    snapshot, start, checked = engines[0]["outer"]["snapshot"], 0, 0
    for bucket in engines[0]["buckets"]:  # os = N (plain DDP inside islands): a bucket's whole flat buffer
        layout = bucket["layout"]
        for name, off, shape in zip(layout["names"], layout["offsets"], layout["shapes"]):
            size = torch.Size(shape).numel()
            assert torch.equal(weights[name], snapshot[start + off : start + off + size].view(shape)), name
            checked += 1
        start += layout["padded"]
    own = torch.cat([m.reshape(-1) for b in engines[0]["buckets"] for m in b["masters"]])
    assert checked == len(weights) and not torch.equal(own, snapshot)


@pytest.mark.slow
def test_run_sh_refuses_one_island(run_sh_data_dir):
    proc = run_sh(
        run_sh_data_dir,
        "--micro-batch-size",
        "4",
        "--outer-algorithm",
        "diloco",
        "--train-iters",
        "2",
        nproc=4,
        ok=False,
    )
    one_line_refusal(proc, "one island")


@pytest.mark.slow
def test_run_sh_streaming_int4_saved_in_flight_resumes(run_sh_data_dir, tmp_path):
    """Two fragments (due at 2, 6 and 4, 8 with H = 4) whose int4 exchanges overlap one step: the
    save at iteration 6 holds the one started at 6 in flight, and the resumed run lands it at 7
    and the next at 9, where the uninterrupted schedule puts them."""
    save = tmp_path / "ckpt"
    flags = [
        *OUTER[:-2],
        "--outer-sync-every",
        "4",
        "--outer-fragments",
        "2",
        "--outer-overlap-steps",
        "1",
        "--outer-quantize",
        "int4",
        "--log-interval",
        "1",
        "--save",
        str(save),
    ]
    first = run_sh(run_sh_data_dir, *flags, "--train-iters", "6", nproc=4)
    out = first.stdout + first.stderr
    landed = [line.split("|")[0].split()[1] for line in out.splitlines() if "outer/pseudo_grad_norm" in line]
    assert landed == ["3", "5"], landed
    again = run_sh(run_sh_data_dir, *flags, "--train-iters", "9", "--load", str(save), nproc=4)
    out = again.stdout + again.stderr
    assert "resumed from" in out
    landed = [line.split("|")[0].split()[1] for line in out.splitlines() if "outer/pseudo_grad_norm" in line]
    assert landed == ["7", "9"], landed
