"""The two-level combination matrix: every island strategy family x outer wire x fragments x
overlap x layout trains, saves and resumes bit for bit.

Each combination runs `pretrain_gpt.main` (the user's path: the config and its checks, the
island topology, the engines, the trainer, the checkpoint manager) on 4 gloo ranks forming 2
islands, in one of three layouts:

- `plain`: 2 nodes of 2 ranks, an island per node, 2 DP ranks in each (the ZeRO shards, the
  fragments and a rank's part of them, maybe none, differ between the ranks of an island);
- `tp2`: 2 nodes of 2 ranks, TP 2 inside each node, so one DP rank per island;
- `pp2`: 4 nodes of 1 rank, PP 2 with the stages on different nodes, so an island is 2 nodes
  with one DP rank.

The model is the end-to-end tests' tiny Llama with 4 layers (2 per pipeline stage, so PP 2 can
hold 2 fragments), H = 2. A run of STEPS steps straight is compared with one that stops,
saving, at SAVE_AT (mid-interval; with 2 fragments and overlap, an exchange in flight) and is
resumed by a fresh process group to STEPS: the losses after SAVE_AT and every tensor of the
final checkpoints (parameters, optimizer and outer state) bit for bit equal; the loss falls,
and the islands' outer snapshots are equal. The config accepts every combination of this
product (none is refused before the ranks start); one that a later rule refuses fails here,
naming the combination, with the refusal's line.

The families: ZeRO-1, 2, 3 (stages), PaRO IIG (hierarchical: parameters and gradients sharded
inside a PaRO group, by default a node, optimizer state over the island; at most 6 ranks cannot
hold 2 islands of 2 nodes of 2 DP ranks, so here a group is the whole island on `plain` and
one rank on the others), ZeRO++ (stage 3 with qwZ, hpZ over 2 ranks and qgZ), LoCo (stage 2
with qgZ and LoCo) and LoRA (stage 1, adapters of rank 4 train, the base is frozen).

Tiers: CI runs `PAIRWISE`, a covering array in which every pair of values of any two factors
occurs (built greedily and deterministically from the product, in its order: 21 combinations,
the fewest possible), about 4 minutes of CPU time, two spawns of 4 ranks (the straight runs
and the first halves, then the resumes) running every selected combination, each job's
process groups destroyed after it (`scoped_groups`: a dozen gloo groups per job, with their
threads, would pile up to thousands of threads per rank). The full product
(`FULL`, 252 combinations) is marked `full_matrix`, which `.ci/run` deselects: run it with
`python3 -m pytest -q -m full_matrix tests/test_outer_matrix.py` (about 12 CPU-seconds per
combination: roughly 25 minutes on 2 quiet cores), or a slice with `-k`, e.g.
`-m full_matrix -k "lora and plain"`. Each test's id names its combination, e.g.
`test_pairwise[zero3-int4-f1-tau0-tp2]`.
"""

from __future__ import annotations

import itertools
import json
import math
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL_FLAGS, data_flags, short_run_flags, state_differences

import pretrain_gpt
from megazpp.launch.local_ranks import run_ranks, scoped_groups

WORLD, H, STEPS, SAVE_AT = 4, 2, 5, 3

FAMILIES = {
    "zero1": "--zero-stage 1".split(),
    "zero2": "--zero-stage 2".split(),
    "zero3": "--zero-stage 3".split(),
    "paro": "--paro-strategy IIG".split(),
    "zeropp": "--zero-stage 3 --zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients".split(),
    "loco": "--zero-stage 2 --zero-quantized-gradients --loco".split(),
    "lora": "--zero-stage 1 --lora-rank 4".split(),
}
WIRES = ("none", "bf16", "int4")
FRAGMENTS = (1, 2)
OVERLAPS = (0, 1)
LAYOUTS = {
    "plain": ["--ranks-per-node", "2"],
    "tp2": ["--ranks-per-node", "2", "--tensor-model-parallel-size", "2"],
    "pp2": ["--ranks-per-node", "1", "--pipeline-model-parallel-size", "2", "--outer-island-nodes", "2"],
}
FACTORS: tuple[Sequence[object], ...] = (tuple(FAMILIES), WIRES, FRAGMENTS, OVERLAPS, tuple(LAYOUTS))


@dataclass(frozen=True)
class Combo:
    family: str
    wire: str
    fragments: int
    overlap: int
    layout: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.wire}-f{self.fragments}-tau{self.overlap}-{self.layout}"

    def flags(self) -> list[str]:
        return [
            *FAMILIES[self.family],
            *LAYOUTS[self.layout],
            "--outer-algorithm",
            "diloco",
            "--outer-sync-every",
            str(H),
            "--outer-quantize",
            self.wire,
            "--outer-fragments",
            str(self.fragments),
            "--outer-overlap-steps",
            str(self.overlap),
        ]


def pairwise(factors: Sequence[Sequence[object]]) -> list[tuple[object, ...]]:
    """A covering array of strength 2: rows of the product such that every pair of values of
    any two factors occurs in some row. Greedy: take the row of the product (in its order)
    that covers the most pairs not yet covered, until none is left."""
    columns = list(itertools.combinations(range(len(factors)), 2))
    product = list(itertools.product(*factors))
    uncovered = {(i, j, a, b) for i, j in columns for a in factors[i] for b in factors[j]}
    rows = []
    while uncovered:
        row = max(product, key=lambda r: sum((i, j, r[i], r[j]) in uncovered for i, j in columns))
        rows.append(row)
        uncovered -= {(i, j, row[i], row[j]) for i, j in columns}
    return rows


FULL = [Combo(*row) for row in itertools.product(*FACTORS)]
PAIRWISE = [Combo(*row) for row in pairwise(FACTORS)]


def _argv(prefix: str, tokenizer: str, combo: Combo, save: Path, *extra: str) -> list[str]:
    return [
        *data_flags(prefix, tokenizer),
        *TINY_MODEL_FLAGS,
        "--num-layers",
        "4",
        *short_run_flags(STEPS),
        *combo.flags(),
        "--save",
        str(save),
        *extra,
    ]


def _runs(prefix: str, tokenizer: str, root: str, combos: list[Combo], part: str) -> dict[str, object]:
    """On every rank, per combination: `first` runs STEPS steps straight, then SAVE_AT steps
    that save and stop; `resume` (a fresh process group) loads that and trains to STEPS. The
    first combination that fails ends the spawn (its peers then fail on the closed group):
    {"losses": per run, "failed": (combination, traceback) or None}."""
    losses: dict[str, dict[int, float]] = {}
    for combo in combos:
        where = Path(root) / combo.name
        try:
            if part == "first":
                with scoped_groups():
                    straight = _argv(prefix, tokenizer, combo, where / "straight")
                    losses[f"{combo.name}/straight"] = pretrain_gpt.main(straight).losses
                with scoped_groups():
                    first = _argv(prefix, tokenizer, combo, where / "resumed", "--exit-interval", str(SAVE_AT))
                    pretrain_gpt.main(first)
            else:
                resumed = where / "resumed"
                with scoped_groups():
                    again = _argv(prefix, tokenizer, combo, resumed, "--load", str(resumed))
                    losses[f"{combo.name}/resumed"] = pretrain_gpt.main(again).losses
        except Exception:
            return {"losses": losses, "failed": (combo.name, traceback.format_exc())}
    return {"losses": losses, "failed": None}


def _spawn(args: tuple[str, str, str], combos: list[Combo], part: str) -> tuple[list[dict], dict[str, str]]:
    """`_runs` of `combos` on WORLD fresh ranks, spawned again after the first failure for the
    combinations after it: per rank its losses, and per failed combination the traceback of
    its first rank that did not merely see a peer's failure."""
    per_rank: list[dict] = [{} for _ in range(WORLD)]
    failures: dict[str, str] = {}
    todo = list(combos)
    while todo:
        ranks = run_ranks(_runs, WORLD, *args, todo, part, timeout_s=300)
        for mine, got in zip(per_rank, ranks):
            mine.update(got["losses"])
        failed = [r["failed"] for r in ranks if r["failed"] is not None]
        if not failed:
            break
        names = [c.name for c in todo]
        first = min(names.index(name) for name, _ in failed)
        causes = [tb for name, tb in failed if name == names[first]]
        failures[names[first]] = next((tb for tb in causes if "CommunicationError" not in tb), causes[0])
        todo = todo[first + 1 :]
    return per_rank, failures


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _last_checkpoint(save: Path) -> Path:
    return save / (save / "latest").read_text().strip()


@pytest.fixture(scope="module")
def matrix_results(request, tiny_indexed_prefix, tiny_tokenizer_model, tmp_path_factory) -> dict[str, object]:
    """Every selected combination that should train, run in two spawns of 4 ranks: one for
    the straight runs and the first halves, one (a fresh process group) for the resumes."""
    selected = [
        item.callspec.params["combo"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "combo" in item.callspec.params
    ]
    combos = list(dict.fromkeys(selected))
    root = tmp_path_factory.mktemp("matrix")
    args = (str(tiny_indexed_prefix), str(tiny_tokenizer_model), str(root))
    first, failures = _spawn(args, combos, "first")
    resumed, resume_failures = _spawn(args, [c for c in combos if c.name not in failures], "resume")
    return {"root": root, "first": first, "resumed": resumed, "failures": {**failures, **resume_failures}}


def _check(combo: Combo, matrix_results: dict) -> None:
    """The combination trained, resumed bit for bit, and its islands agree."""
    failure = matrix_results["failures"].get(combo.name)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    root: Path = matrix_results["root"] / combo.name
    for rank, (first, again) in enumerate(zip(matrix_results["first"], matrix_results["resumed"])):
        straight, resumed = first[f"{combo.name}/straight"], again[f"{combo.name}/resumed"]
        assert sorted(straight) == list(range(1, STEPS + 1)), rank
        assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1)), rank
        # a rank of a stage other than the last has no loss (NaN): both runs agree on which
        assert all(_same_float(resumed[i], straight[i]) for i in resumed), (rank, straight, resumed)
        assert math.isnan(straight[1]) or straight[STEPS] < straight[1], (rank, straight)  # it trains
    a, b = _last_checkpoint(root / "straight"), _last_checkpoint(root / "resumed")
    files = sorted(p.name for p in a.glob("*.pt"))
    assert len(files) == WORLD and files == sorted(p.name for p in b.glob("*.pt"))
    states = {}
    for name in files:
        states[name] = torch.load(a / name, map_location="cpu", weights_only=True)
        again = torch.load(b / name, map_location="cpu", weights_only=True)
        assert state_differences(states[name], again, name) == []
    # rank files are named by global DP rank, the islands' blocks in order: DP rank d of
    # island 0 holds the same shard as d + dp / 2 of island 1, synced to the same snapshot
    dp = json.loads((a / "metadata.json").read_text())["dp"]
    for name in files:
        d = int(name.split("_dp")[1].split(".")[0])
        if d < dp // 2:
            peer = name.replace(f"_dp{d:04d}", f"_dp{d + dp // 2:04d}")
            mine, theirs = states[name]["engine"]["outer"], states[peer]["engine"]["outer"]
            assert torch.equal(mine["snapshot"], theirs["snapshot"]), (name, peer)


@pytest.mark.slow
@pytest.mark.parametrize("combo", PAIRWISE, ids=lambda c: c.name)
def test_pairwise(combo, matrix_results):
    _check(combo, matrix_results)


@pytest.mark.full_matrix
@pytest.mark.parametrize("combo", FULL, ids=lambda c: c.name)
def test_full(combo, matrix_results):
    _check(combo, matrix_results)


def test_pairwise_tier_covers_every_pair_of_values():
    """Every pair of values of any two factors is in some CI combination, with no combination
    twice, in as few as the two largest factors allow (families x wires or layouts)."""
    rows = [(c.family, c.wire, c.fragments, c.overlap, c.layout) for c in PAIRWISE]
    assert len(set(rows)) == len(rows) == len(FAMILIES) * len(WIRES)
    for (i, values_i), (j, values_j) in itertools.combinations(enumerate(FACTORS), 2):
        for a, b in itertools.product(values_i, values_j):
            assert any(row[i] == a and row[j] == b for row in rows), (a, b)
