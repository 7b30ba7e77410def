"""Checks before training on several nodes (megazpp/launch/preflight.py): two gloo ranks as two
virtual nodes, each working in its own directory, so that one relative path can name different
files on each "node", as the same path does on two machines."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from megazpp.errors import LaunchError
from megazpp.launch.local_ranks import run_ranks
from megazpp.launch.preflight import NodeReport, check_nodes, first_difference
from megazpp.parallel.topology import Topology

DATA = "data/corpus_text_document"
TOKENIZER = "data/tokenizer.model"


def _check_in_node_dirs(scenarios: list[tuple[list[str], str | None, list[str]]]) -> list[str | None]:
    """For each (per-node working directories, save dir, data path): the refusal, or None."""
    topology = Topology.from_env(1, 1, ranks_per_node=1)
    results = []
    for dirs, save, data_path in scenarios:
        os.chdir(dirs[topology.rank])
        try:
            check_nodes(topology, data_path, TOKENIZER, save)
            results.append(None)
        except LaunchError as exc:
            results.append(str(exc))
    return results


def _node_dirs(root: Path, name: str, prefix: str, tokenizer: str) -> list[str]:
    dirs = []
    for node in (0, 1):
        work = root / name / str(node)
        (work / "data").mkdir(parents=True)
        for ext in ("bin", "idx"):
            shutil.copy(f"{prefix}.{ext}", work / f"{DATA}.{ext}")
        shutil.copy(tokenizer, work / TOKENIZER)
        dirs.append(str(work))
    return dirs


def test_nodes_that_differ_are_named(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    fixtures = (str(tiny_indexed_prefix), str(tiny_tokenizer_model))
    same = _node_dirs(tmp_path, "same", *fixtures)
    shared = tmp_path / "shared_ckpt"
    other_index = _node_dirs(tmp_path, "index", *fixtures)
    idx = Path(other_index[1]) / f"{DATA}.idx"
    raw = bytearray(idx.read_bytes())
    raw[-1] ^= 1  # same size, different contents
    idx.write_bytes(bytes(raw))
    missing = _node_dirs(tmp_path, "missing", *fixtures)
    (Path(missing[1]) / f"{DATA}.bin").unlink()
    unwritable = _node_dirs(tmp_path, "unwritable", *fixtures)
    (Path(unwritable[0]) / "blocker").mkdir()
    (Path(unwritable[1]) / "blocker").write_text("a file where node 1 needs a directory")
    results = run_ranks(
        _check_in_node_dirs,
        2,
        [
            (same, str(shared), [DATA]),
            (same, None, [DATA]),
            (other_index, str(shared), [DATA]),
            (missing, None, [DATA]),
            (same, "ckpt", [DATA]),  # relative: a different directory on each node
            (unwritable, "blocker/ckpt", [DATA]),
            (same, str(shared), ["0.5", DATA, "0.5"]),  # refused while fingerprinting: no rank hangs
        ],
    )
    assert results[0] == results[1], "every rank reaches the same verdict"
    ok, no_save, index, gone, not_shared, cannot_write, bad_blend = results[0]
    assert ok is None and no_save is None
    assert not list(shared.iterdir()), "probe files are removed"
    host = os.uname().nodename
    assert index.startswith(f"preflight: node 1 ({host}) has {DATA}.idx: ")
    assert "every node needs the same data files" in index and "\n" not in index
    assert index.split(": ")[2].split(", sha256")[0] == index.split(": ")[3].split(", sha256")[0]  # same size
    assert f"node 1 ({host}) has {DATA}.bin: missing, but node 0 ({host}): " in gone
    assert not_shared == (
        f"preflight: node 1 ({host}) and node 0 ({host}) do not see each other's probe "
        f"files in the save directory ckpt: it must be one directory shared by all nodes"
    )
    assert cannot_write.startswith(f"preflight: node 1 ({host}) cannot write to the save directory blocker/ckpt (")
    assert bad_blend.startswith(f"preflight: node 0 ({host}) cannot fingerprint its code and data: ")
    assert f"; node 1 ({host}) cannot fingerprint" in bad_blend


def test_a_different_commit_is_named():
    files = {"d.idx": "10 bytes, sha256 ab"}
    reports = [
        NodeReport(0, "a", "commit 111", files),
        NodeReport(1, "b", "commit 111", files),
        NodeReport(2, "c", "commit 222", files),
    ]
    assert first_difference(reports, None) == (
        "node 2 (c) runs commit 222 but node 0 (a) runs commit 111; check out the same commit on every node"
    )
    assert first_difference(reports[:2], None) is None
