"""`outer.start_iter`: synchronous data parallelism for the first S iterations, islands from S on,
in one job (`megazpp/training/start_iter.py`), against the two jobs it replaces.

Each family runs `pretrain_gpt.main` on 4 gloo ranks (2 nodes of 2, so 2 islands of 2 DP ranks),
the end-to-end tests' tiny Llama, STEPS steps, S = START, H = 2 (so the first outer sync lands at
4, the first multiple of H after S), saving every step:
- `switch`: the one job, `--outer-start-iter START`;
- `sync` then `warm`: a synchronous run (outer.algorithm none, the same zero strategy) stopped
  and saved at START, then a two-level run warm-started from that checkpoint (`--load`);
- resumes of `switch` from its checkpoint before S (synchronous: it resumes the synchronous
  phase, then switches), at S and after S (two-level ones), each by a fresh process group.
Asserted bit for bit: the losses of every step and every tensor of the final checkpoints
(parameters, optimizer and outer state, RNGs) of `switch` equal `sync` + `warm`, and every
resume equals `switch`; the checkpoints before S are synchronous (the engine over all 4 DP ranks,
no outer state), those from S on two-level; at the switch the outer snapshot is the masters and
the momentum zero; the synchronous engine was freed; the TensorBoard communication scalars of
`switch` equal `sync`'s before S and `warm`'s after (the inter-node bytes change at S).
Families: ZeRO-2 with fp32 outer gradients, and ZeRO-3 with int4 ones (error feedback buffers
start at zero at the switch, as at a warm start).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL_FLAGS, data_flags, short_run_flags, state_differences

import pretrain_gpt
from megazpp.analysis.event_reader import read_run
from megazpp.checkpoint.format import is_two_level, read_metadata
from megazpp.checkpoint.manager import CheckpointManager
from megazpp.checkpoint.resume_check import check_resumable
from megazpp.config.load import load_config
from megazpp.config.schema import Config
from megazpp.errors import CheckpointError
from megazpp.interop.consolidate import two_level_note
from megazpp.launch.local_ranks import run_ranks, scoped_groups

WORLD, H, STEPS, START = 4, 2, 6, 3
RESUME_AT = (START - 1, START, START + 1)  # before, at and after the switch
FAMILIES = {
    "zero2": ["--zero-stage", "2"],
    "zero3-int4": ["--zero-stage", "3", "--outer-quantize", "int4"],
}
TWO_LEVEL = ["--outer-algorithm", "diloco", "--outer-sync-every", str(H)]


def _argv(prefix: str, tokenizer: str, family: str, save: Path, *extra: str, outer: bool = True) -> list[str]:
    zero = FAMILIES[family]
    wire = zero[2:] if outer else []  # the outer wire only where two-level training is on
    return [
        *data_flags(prefix, tokenizer),
        *TINY_MODEL_FLAGS,
        *short_run_flags(STEPS),
        "--ranks-per-node",
        "2",
        "--save-interval",
        "1",
        *zero[:2],
        *(TWO_LEVEL + wire if outer else []),
        "--save",
        str(save),
        *extra,
    ]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _job(out: dict[str, object], family: str, name: str, argv: list[str], where: Path) -> None:
    """One job in its own process groups: its losses and the logging rank's console in `out`."""
    extra = ["--tensorboard-dir", str(where / f"tb_{name}")] if family == "zero2" else []
    console = io.StringIO()
    with scoped_groups(), contextlib.redirect_stdout(console):
        out[f"{family}/{name}"] = pretrain_gpt.main(argv + extra).losses
    out[f"{family}/{name}/console"] = console.getvalue()


def _runs(prefix: str, tokenizer: str, root: str, part: str) -> dict[str, object]:
    """On every rank, per family: `first` runs `switch`, `sync` and `warm`; `resume` (a fresh
    process group) the resumes of `switch`. Returns per run its losses, the logging rank's
    console and the switch's warnings."""
    out: dict[str, object] = {}
    warnings = _Warnings()
    logging.getLogger("megazpp.training.start_iter").addHandler(warnings)
    for family in FAMILIES:
        where = Path(root) / family
        if part == "first":
            switch = _argv(prefix, tokenizer, family, where / "switch", "--outer-start-iter", str(START))
            _job(out, family, "switch", switch, where)
            sync = _argv(prefix, tokenizer, family, where / "sync", "--exit-interval", str(START), outer=False)
            _job(out, family, "sync", sync, where)
            warm = _argv(prefix, tokenizer, family, where / "warm", "--load", str(where / "sync"))
            _job(out, family, "warm", warm, where)
        else:
            for k in RESUME_AT:
                again = where / f"resume{k}"
                argv = _argv(prefix, tokenizer, family, again, "--outer-start-iter", str(START), "--load", str(again))
                _job(out, family, f"resume{k}", argv, where)
    out["warnings"] = warnings.lines
    return out


@pytest.fixture(scope="module")
def start_iter_runs(tiny_indexed_prefix, tiny_tokenizer_model, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("start_iter")
    args = (str(tiny_indexed_prefix), str(tiny_tokenizer_model), str(root))
    first = run_ranks(_runs, WORLD, *args, "first", timeout_s=300)
    for family in FAMILIES:  # each resume starts from a copy of one of switch's checkpoints
        for k in RESUME_AT:
            name = f"iter_{k:07d}"
            shutil.copytree(root / family / "switch" / name, root / family / f"resume{k}" / name)
            (root / family / f"resume{k}" / "latest").write_text(name)
    resumed = run_ranks(_runs, WORLD, *args, "resume", timeout_s=300)
    return {"root": root, "first": first, "resumed": resumed}


def _rank_states(checkpoint: Path) -> dict[str, dict]:
    return {p.name: torch.load(p, map_location="cpu", weights_only=True) for p in sorted(checkpoint.glob("*.pt"))}


def _same(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(a[i] == b[i] or (math.isnan(a[i]) and math.isnan(b[i])) for i in a)


def _final(save: Path) -> Path:
    return save / (save / "latest").read_text().strip()


def _equal_checkpoints(a: Path, b: Path) -> None:
    mine, theirs = _rank_states(a), _rank_states(b)
    assert len(mine) == WORLD and mine.keys() == theirs.keys()
    for name in mine:
        assert state_differences(mine[name], theirs[name], name) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_start_iter_is_a_synchronous_run_then_a_warm_start_bit_for_bit(family, start_iter_runs):
    root: Path = start_iter_runs["root"] / family
    for rank, got in enumerate(start_iter_runs["first"]):
        switch, sync, warm = got[f"{family}/switch"], got[f"{family}/sync"], got[f"{family}/warm"]
        assert sorted(switch) == list(range(1, STEPS + 1)), rank
        assert _same({i: switch[i] for i in sync}, sync) and sorted(sync) == list(range(1, START + 1)), rank
        assert _same({i: switch[i] for i in warm}, warm) and sorted(warm) == list(range(START + 1, STEPS + 1)), rank
        assert switch[STEPS] < switch[1], (rank, switch)  # it trains
    _equal_checkpoints(_final(root / "switch"), _final(root / "warm"))
    console = start_iter_runs["first"][0][f"{family}/switch/console"]
    assert f"two-level from iteration {START} (outer.start_iter)" in console  # the banner
    assert f"iter {START}: outer.start_iter: synchronous data parallelism ends" in console
    assert "first outer sync lands at iteration 4" in console
    assert all("still referenced" not in w for r in start_iter_runs["first"] for w in r["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_start_iter_checkpoints_before_at_and_after_the_switch_resume_bit_for_bit(family, start_iter_runs):
    root: Path = start_iter_runs["root"] / family
    for rank, (first, again) in enumerate(zip(start_iter_runs["first"], start_iter_runs["resumed"])):
        for k in RESUME_AT:
            resumed = again[f"{family}/resume{k}"]
            assert sorted(resumed) == list(range(k + 1, STEPS + 1)), (rank, k)
            assert _same({i: first[f"{family}/switch"][i] for i in resumed}, resumed), (rank, k)
    for k in RESUME_AT:
        _equal_checkpoints(_final(root / "switch"), _final(root / f"resume{k}"))
    before = _rank_states(root / "switch" / f"iter_{START - 1:07d}")
    at = _rank_states(root / "switch" / f"iter_{START:07d}")
    for state in before.values():  # synchronous: the engine over all 4 DP ranks, no outer state
        assert state["engine"]["dp"] == WORLD and "outer" not in state["engine"]
    for state in at.values():  # two-level: an island's 2 DP ranks, snapshot = masters, momentum 0
        engine = state["engine"]
        masters = torch.cat([m.reshape(-1) for b in engine["buckets"] for m in b["masters"]])
        assert engine["dp"] == WORLD // 2 and engine["outer"]["inner_steps"] == START
        assert torch.equal(engine["outer"]["snapshot"], masters)
        assert not engine["outer"]["momentum"].any()


@pytest.mark.slow
def test_start_iter_tensorboard_bytes_are_the_synchronous_runs_then_the_islands(start_iter_runs):
    """The communication scalars of the one job equal those of the synchronous run before S and
    of the warm-started run after: the inter-node bytes fall at S and rise at each outer sync."""
    root: Path = start_iter_runs["root"] / "zero2"
    runs = {name: read_run(root / f"tb_{name}", name).scalars for name in ("switch", "sync", "warm")}
    tags = [t for t in runs["switch"] if t.startswith(("comm/", "outer/")) and "bytes" in t]
    assert "comm/inter_bytes" in tags and "outer/inter_bytes" in tags
    for tag in tags:
        switch = runs["switch"][tag]
        for other, (lo, hi) in (("sync", (1, START)), ("warm", (START + 1, STEPS))):
            mine = switch.within(lo, hi)
            ref = runs[other][tag].within(lo, hi) if tag in runs[other] else None  # an op of one phase only
            assert (list(mine.steps), list(mine.values)) == (
                (list(ref.steps), list(ref.values)) if ref is not None else ([], [])
            ), (tag, other)
    inter = dict(zip(runs["switch"]["comm/inter_bytes"].steps, runs["switch"]["comm/inter_bytes"].values))
    # the synchronous ZeRO-2 step crosses the nodes; an island's step between syncs does not (the
    # loss's 4-byte logging sum over all ranks aside), a sync step carries the outer exchange
    assert inter[START] > 100 * inter[START + 2] and inter[START + 1] > 100 * inter[START + 2]


def _only(checkpoint: Path, where: Path) -> Path:
    """A save directory holding a copy of `checkpoint` alone, as its latest."""
    shutil.copytree(checkpoint, where / checkpoint.name)
    (where / "latest").write_text(checkpoint.name)
    return where


def test_start_iter_checkpoints_are_synchronous_before_it_for_every_reader(
    start_iter_runs, tiny_indexed_prefix, tiny_tokenizer_model, tmp_path
):
    """What the loads and exports decide before any rank, from a checkpoint's metadata
    (`format.is_two_level`): before S a synchronous checkpoint (any run, synchronous or two-level,
    starts from it; resharding takes it; the export has no two-level note); from S a two-level
    one, which a run whose outer.start_iter lies past its iteration cannot start (one line)."""
    switch = start_iter_runs["root"] / "zero2" / "switch"
    before, after = switch / f"iter_{START - 1:07d}", switch / f"iter_{START + 1:07d}"
    assert not is_two_level(read_metadata(before)) and is_two_level(read_metadata(after))
    assert two_level_note(str(before)) is None
    assert f"at the last outer sync (iteration {START + 1}; every {H} steps)" in (two_level_note(str(after)) or "")
    CheckpointManager._check_reshardable(str(_only(before, tmp_path / "before")))
    with pytest.raises(CheckpointError, match="a two-level"):
        CheckpointManager._check_reshardable(str(_only(after, tmp_path / "after")))
    late = START + 2

    def config(*flags: str, outer: bool = True) -> Config:
        data = (str(tiny_indexed_prefix), str(tiny_tokenizer_model))
        return load_config(_argv(*data, "zero2", tmp_path / "new", *flags, outer=outer))

    for cfg in (config(outer=False), config("--outer-start-iter", "1"), config("--outer-start-iter", str(late))):
        check_resumable(cfg, str(tmp_path / "before"), WORLD, 2)  # synchronous, warm start, synchronous phase
    check_resumable(config("--outer-start-iter", str(START)), str(tmp_path / "after"), WORLD, 2)
    with pytest.raises(CheckpointError) as refused:
        check_resumable(config("--outer-start-iter", str(late)), str(tmp_path / "after"), WORLD, 2)
    assert str(refused.value).startswith(
        f"--load {tmp_path / 'after'}: {after.name} holds the islands' state at iteration {START + 1}; this run's "
        f"outer.start_iter {late} would train synchronously until then, and the islands' parameters and "
        f"optimizer states are no one synchronous state: resume it with --outer-start-iter at most {START + 1}"
    )
