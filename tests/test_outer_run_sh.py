"""Two-level training as a user runs it: `run.sh` on 4 ranks carved into 2 nodes of 2 (two
islands), saving and logging; the banner, the outer syncs in the log and in TensorBoard, a
resume, the export of the synced parameters (per fragment when streaming); refusals in one line
before any rank starts (one island; the loads a two-level checkpoint cannot start); and the
changes a resume may make (the warm start from a synchronous run, H, the outer lr, the wire)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megazpp.analysis.event_reader import read_run
from megazpp.checkpoint.reader import CheckpointReader
from tests.test_first_hour import one_line_refusal, run_sh, tool

OUTER = ["--micro-batch-size", "4", "--ranks-per-node", "2", "--outer-algorithm", "diloco", "--outer-sync-every", "5"]
# two fragments, due at 2, 6 and 4, 8 with H = 4, whose int4 exchanges overlap one step
STREAMING = {
    "--micro-batch-size": "4",
    "--ranks-per-node": "2",
    "--outer-algorithm": "diloco",
    "--outer-sync-every": "4",
    "--outer-fragments": "2",
    "--outer-overlap-steps": "1",
    "--outer-quantize": "int4",
}


def flat(flags: dict[str, str]) -> list[str]:
    return [item for pair in flags.items() for item in pair]


def landed_at(out: str) -> list[str]:
    """The iterations whose console line logs an outer sync landing."""
    return [line.split("|")[0].split()[1] for line in out.splitlines() if "outer/pseudo_grad_norm" in line]


@pytest.mark.slow
def test_run_sh_two_level_trains_saves_resumes_and_exports(run_sh_data_dir, tmp_path):
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    proc = run_sh(
        run_sh_data_dir,
        *OUTER,
        "--outer-optimizer-state-every",  # AdamW's two moments averaged at the second sync only
        "2",
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
    assert "the inner optimizer's exp_avg and exp_avg_sq averaged across islands every 2 sync(s)" in out
    scalars = read_run(tb, "two-level").scalars
    assert list(scalars["outer/inter_bytes"].steps) == [5, 10]
    none, both = scalars["outer/moments_inter_bytes"].values  # none at the first sync, two moments at the second
    assert none == 0 and both > 0 and both == 2 * scalars["outer/inter_bytes"].values[0]  # each the fp32 wire's
    assert all(v > 0 for v in scalars["outer/island_divergence"].values)
    assert (save / "latest").read_text().strip().endswith("12")

    # int4 carries error buffers from sync to sync, which a run on the fp32 wire never made
    one_line_refusal(
        run_sh(
            run_sh_data_dir,
            *OUTER,
            "--outer-quantize",
            "int4",
            "--train-iters",
            "16",
            "--load",
            str(save),
            "--save",
            str(tmp_path / "int4"),
            "--tensorboard-dir",
            str(tb),
            nproc=4,
            ok=False,
        ),
        f"--load {save}: iter_0000012 was saved with outer.quantize none, without the error buffers int4 carries",
    )
    resumed = run_sh(
        run_sh_data_dir,
        *OUTER,
        "--train-iters",
        "16",
        "--save",
        str(save),
        "--load",
        str(save),
        "--tensorboard-dir",
        str(tb),
        nproc=4,
    )
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
        *flat(STREAMING),
        "--log-interval",
        "1",
        "--save",
        str(save),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    first = run_sh(run_sh_data_dir, *flags, "--train-iters", "6", nproc=4)
    out = first.stdout + first.stderr
    # the banner says every outer setting in words (it said "none outer gradients", no fragments)
    assert (
        "DiLoCo every 4 inner steps to the islands' mean (plain averaging: outer lr 1, no momentum); the model in "
        "2 fragments at staggered steps (streaming; one fragment a sync step); each exchange runs while 1 inner "
        "step(s) go on, then is merged keeping 0.5 of the island's own parameters; outer gradients sent as int4 "
        "with error feedback: "
    ) in out
    assert landed_at(out) == ["3", "5"]
    # what this checkpoint cannot start: one line before any rank (each used to fail on every rank,
    # the wire change as a tensor size mismatch at the first landing); its files untouched
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (save / "iter_0000006").iterdir())
    elsewhere = ["--save", str(tmp_path / "other"), "--tensorboard-dir", str(tmp_path / "tb2"), "--load", str(save)]
    at6 = f"--load {save}: iter_0000006"
    for argv, expected in (
        (  # into a synchronous run
            ["--micro-batch-size", "4", "--ranks-per-node", "2"],
            f"{at6} is a two-level (diloco) checkpoint of 2 islands, each with its own parameters and optimizer "
            "state; this run is synchronous (outer.algorithm none): continue it with --outer-algorithm diloco",
        ),
        (  # onto other islands: 4 islands of 1 rank
            flat({**STREAMING, "--ranks-per-node": "1"}),
            f"{at6} was saved by 2 islands of 2 data-parallel rank(s); this run has 4 of 1",
        ),
        (
            flat({**STREAMING, "--outer-fragments": "1"}),
            f"{at6} was saved with outer.fragments 2, this run has 1: its outer state (exchanges in flight, int4 "
            "error buffers) is cut into those fragments: resume it with --outer-fragments 2",
        ),
        (
            flat({**STREAMING, "--outer-quantize": "none"}),
            f"{at6} holds 1 outer exchange(s) in flight, encoded as int4; this run sends none: resume it with "
            "--outer-quantize int4",
        ),
    ):
        refusal = run_sh(run_sh_data_dir, *argv, "--train-iters", "9", *elsewhere, nproc=4, ok=False)
        one_line_refusal(refusal, expected)
        assert "iter " not in refusal.stdout and not (tmp_path / "other").exists()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (save / "iter_0000006").iterdir()) == before
    # the export says what each fragment holds: not "the last outer sync (iteration 4)" for both
    export = tool("tools/export_checkpoint.py", "--load", str(save), "--out", str(tmp_path / "at6.safetensors"))
    assert (
        "exported are the islands' averaged parameters at each fragment's last applied outer sync (2 fragments, "
        "every 4 steps, overlap 1): fragment 0 at iteration 4; fragment 1 at iteration 2, its exchange of "
        "iteration 6 in flight; not any island's own since"
    ) in export.stdout, export.stdout
    again = run_sh(run_sh_data_dir, *flags, "--train-iters", "9", "--load", str(save), nproc=4)
    out = again.stdout + again.stderr
    assert "resumed from" in out
    assert landed_at(out) == ["7", "9"]


@pytest.mark.slow
def test_run_sh_warm_start_from_a_synchronous_checkpoint_and_the_outer_changes_a_resume_may_make(
    run_sh_data_dir, tmp_path
):
    """Synchronous ZeRO-1 over 4 ranks, then two-level training from its checkpoint (the warm start:
    resharded to islands of 2, the first interval starting at its weights), then a resume that
    changes H, the outer lr and the wire with nothing in flight: each starts, none refused."""
    sync, two = tmp_path / "sync", tmp_path / "two"
    base = ["--micro-batch-size", "4", "--zero-stage", "1", "--log-interval", "1"]
    run_sh(
        run_sh_data_dir,
        *base,
        "--train-iters",
        "4",
        "--save",
        str(sync),
        "--tensorboard-dir",
        str(tmp_path / "tb1"),
        nproc=4,
    )

    def two_level(load: Path, iters: int, *outer: str) -> str:
        flags = ["--ranks-per-node", "2", "--outer-algorithm", "diloco", *outer, "--train-iters", str(iters)]
        own = ["--load", str(load), "--save", str(two), "--tensorboard-dir", str(tmp_path / "tb2")]
        proc = run_sh(run_sh_data_dir, *base, *flags, *own, nproc=4)
        return proc.stdout + proc.stderr

    out = two_level(sync, 6, "--outer-sync-every", "2")
    assert f"resumed from {sync / 'iter_0000004'} at iteration 4" in out
    assert "the first outer interval starts at its weights" in out
    assert landed_at(out) == ["6"]  # inner steps count on from the checkpoint's 4: H = 2 syncs at 6
    out = two_level(
        two, 9, "--outer-sync-every", "3", "--outer-lr", "1.0", "--outer-momentum", "0", "--outer-quantize", "bf16"
    )
    assert f"resumed from {two / 'iter_0000006'} at iteration 6" in out
    assert landed_at(out) == ["9"]
