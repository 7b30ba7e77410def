"""The `outer` section: flags, its checked options, and every refusal, before any rank starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megazpp.config.checks import check_config
from megazpp.config.load import load_config
from megazpp.errors import ConfigError
from megazpp.outer.settings import OuterOptions

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = ["--outer-algorithm", "diloco", "--outer-elastic", "--outer-lighthouse", "127.0.0.1:29510"]


def _outer(flags: list[str], world: int = 4, per_node: int | None = 2) -> OuterOptions | None:
    return check_config(load_config(flags), world, per_node).outer


def test_flags_resolve_to_options():
    assert _outer([]) is None
    o = _outer(
        [
            "--outer-algorithm",
            "diloco",
            "--outer-sync-every",
            "5",
            "--outer-lr",
            "0.5",
            "--outer-momentum",
            "0.8",
            "--outer-quantize",
            "bf16",
            "--outer-fragments",
            "2",
        ]
    )
    assert o == OuterOptions(
        algorithm="diloco", sync_every=5, lr=0.5, momentum=0.8, quantize="bf16", island_nodes=1, fragments=2
    )
    assert _outer(["--outer-algorithm", "diloco", "--outer-island-nodes", "2"], world=8).island_nodes == 2
    assert _outer(["--outer-algorithm", "diloco", "--outer-optimizer-state-every", "3"]).optimizer_state_every == 3
    assert _outer(["--outer-algorithm", "diloco"]).optimizer_state_every == 1  # the defaults (defaults600)
    sgd = ["--outer-algorithm", "diloco", "--optimizer", "sgd", "--outer-optimizer-state-every", "2"]
    assert _outer(sgd).optimizer_state_every == 2  # its momentum buffer
    # SGD without momentum keeps no state: the default period has nothing to average, and says so in the banner
    assert _outer(["--outer-algorithm", "diloco", "--optimizer", "sgd", "--sgd-momentum", "0"]).optimizer_state_every
    assert not _outer(
        ["--outer-algorithm", "diloco", "--outer-quantize", "int4", "--no-outer-error-feedback"]
    ).error_feedback
    # auto with islands: accepted here, the island's strategy is chosen once the ranks probed their links
    # (tests/test_outer_auto.py runs it)
    assert _outer(["--outer-algorithm", "diloco", "--paro-strategy", "auto"]).island_nodes == 1
    # islands from 7, H = 4: the first sync lands at 8, the run's last step
    late = ["--outer-algorithm", "diloco", "--train-iters", "8", "--outer-sync-every", "4", "--outer-start-iter", "7"]
    assert _outer(late).start_iter == 7


@pytest.mark.parametrize(
    "flags, world, per_node, message",
    [
        (["--outer-algorithm", "lococo"], 4, 2, "outer.algorithm = 'lococo': expected one of none, diloco"),
        (["--outer-sync-every", "5"], 4, 2, "outer.sync_every = 5 is set but outer.algorithm is none"),
        (["--outer-algorithm", "diloco", "--outer-sync-every", "0"], 4, 2, "outer.sync_every = 0"),
        (["--outer-algorithm", "diloco", "--outer-lr", "0"], 4, 2, "outer.lr = 0.0"),
        (["--outer-algorithm", "diloco", "--outer-momentum", "1"], 4, 2, "outer.momentum = 1.0"),
        (["--outer-algorithm", "diloco", "--outer-quantize", "int8"], 4, 2, "outer.quantize = 'int8'"),
        (["--outer-algorithm", "diloco", "--outer-fragments", "0"], 4, 2, "outer.fragments = 0"),
        (
            ["--outer-algorithm", "diloco", "--outer-fragments", "6", "--outer-sync-every", "5"],
            4,
            2,
            "outer.fragments = 6 > outer.sync_every = 5",
        ),
        (
            ["--outer-algorithm", "diloco", "--outer-overlap-steps", "5", "--outer-sync-every", "5"],
            4,
            2,
            "outer.overlap_steps = 5: a fragment's exchange must land",
        ),
        (["--outer-algorithm", "diloco", "--outer-merge-alpha", "0.3"], 4, 2, "outer.overlap_steps is 0"),
        (
            ["--outer-algorithm", "diloco", "--outer-merge-alpha", "1.5", "--outer-overlap-steps", "1"],
            4,
            2,
            "outer.merge_alpha = 1.5",
        ),
        (["--outer-algorithm", "diloco", "--outer-island-nodes", "0"], 4, 2, "outer.island_nodes = 0"),
        (
            ["--outer-algorithm", "diloco", "--outer-optimizer-state-every", "-1"],
            4,
            2,
            "outer.optimizer_state_every = -1: expected 0",
        ),
        (["--outer-optimizer-state-every", "3"], 4, 2, "outer.optimizer_state_every = 3 is set but outer.algorithm"),
        (["--outer-start-iter", "5"], 4, 2, "outer.start_iter = 5 is set but outer.algorithm is none"),
        (["--outer-algorithm", "diloco", "--outer-start-iter", "-1"], 4, 2, "outer.start_iter = -1: expected"),
        (
            ["--outer-algorithm", "diloco", "--train-iters", "10", "--outer-start-iter", "10"],
            4,
            2,
            "outer.start_iter = 10 with training.train_iters = 10: the islands would start after the run's last "
            "step, so it would train synchronously throughout: give outer.start_iter below 10",
        ),
        (  # islands from 8, H = 4: the first sync at 12
            ["--outer-algorithm", "diloco", "--train-iters", "10", "--outer-sync-every", "4"]
            + ["--outer-start-iter", "8"],
            4,
            2,
            "outer.start_iter = 8, outer.sync_every = 4 with training.train_iters = 10: the islands start at 8 and "
            "their first outer sync (at the multiples of H, plus outer.overlap_steps 0) would land at 12, past",
        ),
        (  # ... at 8, landing one step later
            ["--outer-algorithm", "diloco", "--train-iters", "8", "--outer-sync-every", "4", "--outer-start-iter", "4"]
            + ["--outer-overlap-steps", "1"],
            4,
            2,
            "would land at 9, past the run's end",
        ),
        (
            ["--outer-algorithm", "diloco", "--outer-quantize", "bf16", "--no-outer-error-feedback"],
            4,
            2,
            "outer.error_feedback = false: only the int4 wire drops anything",
        ),
        (
            ["--outer-algorithm", "diloco", "--outer-fragments", "3", "--outer-sync-every", "4", "--num-layers", "2"],
            4,
            2,
            "a pipeline stage holds 2 layer(s)",
        ),
        (
            ["--outer-algorithm", "diloco", "--optimizer", "sgd", "--sgd-momentum", "0"]
            + ["--outer-optimizer-state-every", "6"],
            4,
            2,
            "outer.optimizer_state_every = 6: the inner optimizer (sgd, momentum 0) keeps no state to average",
        ),
        (["--outer-algorithm", "diloco"], 4, 4, "one island of all 1 node(s)"),
        (["--outer-algorithm", "diloco", "--outer-island-nodes", "2"], 4, 2, "one island of all 2 node(s)"),
        (["--outer-algorithm", "diloco", "--outer-island-nodes", "3"], 8, 2, "positive divisor of the 4 node(s)"),
        # stages on different nodes: island 0 (DP rank 0 with both stages) spans nodes 0 and 2
        (
            ["--outer-algorithm", "diloco", "--pipeline-model-parallel-size", "2"],
            8,
            2,
            "spans nodes [0, 2], not 1 whole",
        ),
        (
            ["--outer-algorithm", "diloco", "--pipeline-model-parallel-size", "2"],
            4,
            1,
            "cannot split the data-parallel size 2",
        ),
        # elastic islands (docs/arch/elastic.md)
        (["--outer-algorithm", "diloco", "--outer-elastic"], 1, 1, "outer.elastic needs the membership service's"),
        (["--outer-algorithm", "diloco", "--outer-elastic", "--outer-lighthouse", "h"], 1, 1, "outer.lighthouse = 'h'"),
        ([*ELASTIC, "--outer-min-islands", "0"], 1, 1, "outer.min_islands = 0: expected at least 1"),
        ([*ELASTIC, "--outer-island-id", "-1"], 1, 1, "outer.island_id = -1"),
        ([*ELASTIC, "--outer-sync-timeout-s", "0"], 1, 1, "outer.sync_timeout_s = 0.0"),
        ([*ELASTIC, "--outer-train-samples", "-1"], 1, 1, "outer.train_samples = -1: expected a number"),
        (["--outer-algorithm", "diloco", "--outer-train-samples", "64"], 4, 2, "is an elastic setting and outer."),
        (["--outer-algorithm", "diloco", "--outer-lighthouse", "h:1"], 4, 2, "is an elastic setting and outer.elastic"),
        ([*ELASTIC, "--outer-quantize", "bf16"], 1, 1, "outer.quantize = 'bf16' with outer.elastic"),
        ([*ELASTIC, "--outer-fragments", "2"], 1, 1, "outer.fragments = 2 with outer.elastic"),
        ([*ELASTIC, "--outer-island-nodes", "2"], 1, 1, "outer.island_nodes = 2 with outer.elastic"),
    ],
)
def test_refusals(flags, world, per_node, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _outer(flags, world, per_node)


def test_an_elastic_island_is_its_jobs_whole_world():
    """One rank, or 4 on 2 nodes: either way one island (the islands are other jobs), so the
    synchronous rule "at least two islands of whole nodes" does not apply."""
    for world, per_node in ((1, 1), (4, 2)):
        o = _outer([*ELASTIC, "--outer-island-id", "3", "--outer-min-islands", "2"], world, per_node)
        assert o is not None and o.elastic and (o.island_id, o.min_islands, o.lighthouse) == (3, 2, "127.0.0.1:29510")


def test_refused_before_any_rank_starts(tmp_path):
    """run.sh's once-per-job check refuses one island in one line, no rank started."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megazpp.training.startup",
            "--world-size",
            "4",
            "--ranks-on-node",
            "4",
            "--node-rank",
            "0",
            "--outer-algorithm",
            "diloco",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "one island" in lines[0], proc.stderr


def test_checkpoints_saved_before_the_section_resume_unchanged():
    """A run saved before the `outer` section existed has the same settings as one with its
    defaults; turning two-level training on is a change the resume rule names."""
    from megazpp.checkpoint.resume_rule import settings_diff

    saved = load_config([]).to_dict()
    del saved["outer"]
    assert settings_diff(saved, load_config([]).to_dict()) == []
    assert settings_diff(saved, load_config(["--outer-algorithm", "diloco"]).to_dict()) == [
        "outer.algorithm none -> diloco"
    ]
