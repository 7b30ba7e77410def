"""Checks every node of a multi-node run passes before any work starts: the same code, the same
data files, and a save directory that all nodes share and can write.

Three launch paths reach training (by hand, SLURM, a hostfile) and the only channel the nodes
surely share is the process group they just formed, so the checks run right after it, over
two counted `all_gather_object` calls, before datasets, model or checkpoints are touched. One
rank per node (the first) does the file work. Every rank receives the same reports and
reaches the same verdict, so a refusal stops all ranks together with the same one-line
message naming the node that differs from node 0; none is left waiting in a collective.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megazpp.data.options import parse_data_path
from megazpp.errors import LaunchError, MegazppError
from megazpp.parallel import comm
from megazpp.parallel.topology import Topology

REPO = Path(__file__).resolve().parents[2]
SOURCE_GLOBS = ("megazpp/**/*.py", "kernels/**/*.py", "pretrain_gpt.py", "run.sh")
TAG = "launch/preflight"
PROBE_PREFIX = ".megazpp-probe-"


@dataclass
class NodeReport:
    """What one node found; `problem` is the node's own failure (e.g. it cannot write)."""

    node: int
    host: str
    code: str
    files: dict[str, str]
    probe: str | None = None
    problem: str | None = None
    unseen: list[int] = field(default_factory=list)  # nodes whose probe file this node cannot read

    @property
    def name(self) -> str:
        return f"node {self.node} ({self.host})"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest is Python 3.11+; requires-python admits 3.10
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def code_version(root: Path = REPO) -> str:
    """`commit <sha>` (with a hash of uncommitted changes to tracked files), or, without git,
    a hash of the sources."""

    def git(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=False)

    try:
        head = git("rev-parse", "HEAD")
    except OSError:  # no git on this node
        head = None
    if head is not None and head.returncode == 0:
        version = f"commit {head.stdout.decode().strip()[:12]}"
        diff = git("diff", "HEAD", "--", ".").stdout
        return f"{version} + uncommitted changes {hashlib.sha256(diff).hexdigest()[:12]}" if diff else version
    digest = hashlib.sha256()
    for path in sorted({p for pattern in SOURCE_GLOBS for p in root.glob(pattern)}):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return f"sources {digest.hexdigest()[:12]}"


def data_files(data_path: Sequence[str], tokenizer_model: str | None) -> dict[str, str]:
    """Each data prefix's `.bin` by size, its `.idx` and the tokenizer by size and sha256."""
    found: dict[str, str] = {}
    prefixes = [prefix for _, prefix in parse_data_path(data_path)]
    paths = [(Path(f"{p}.bin"), False) for p in prefixes] + [(Path(f"{p}.idx"), True) for p in prefixes]
    if tokenizer_model:
        paths.append((Path(tokenizer_model), True))
    for path, hashed in paths:
        if not path.is_file():
            found[str(path)] = "missing"
            continue
        size = f"{path.stat().st_size} bytes"
        found[str(path)] = f"{size}, sha256 {_sha256(path)[:16]}" if hashed else size
    return found


def _write_probe(save_dir: Path, node: int) -> tuple[str | None, str | None]:
    """(probe file name, None) or (None, why this node cannot write the save directory)."""
    name = f"{PROBE_PREFIX}node{node}-{uuid.uuid4().hex[:12]}"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / name).write_text(name)
    except OSError as exc:
        return None, f"cannot write to the save directory {save_dir} ({exc.strerror or exc})"
    return name, None


def _reads_probe(save_dir: Path, name: str) -> bool:
    try:
        return (save_dir / name).read_text() == name
    except OSError:
        return False


def first_difference(reports: list[NodeReport], save_dir: str | None) -> str | None:
    """One line naming each node that differs from node 0, or None when all agree."""
    problems = [f"{r.name} {r.problem}" for r in reports if r.problem]
    if problems:  # a node that could not look has nothing to compare
        return "; ".join(problems)
    ref = reports[0]
    for report in reports:
        if report.code != ref.code:
            problems.append(
                f"{report.name} runs {report.code} but {ref.name} runs {ref.code}; "
                f"check out the same commit on every node"
            )
        elif report.files != ref.files:
            path = next(p for p in ref.files if report.files.get(p) != ref.files[p])
            problems.append(
                f"{report.name} has {path}: {report.files.get(path)}, but {ref.name}: "
                f"{ref.files[path]}; every node needs the same data files"
            )
        elif report.node != 0 and (report.node in ref.unseen or 0 in report.unseen):
            problems.append(
                f"{report.name} and {ref.name} do not see each other's probe files in the save "
                f"directory {save_dir}: it must be one directory shared by all nodes"
            )
    return "; ".join(problems) or None


def check_nodes(
    topology: Topology, data_path: Sequence[str], tokenizer_model: str | None, save_dir: str | None
) -> None:
    """Collective over the world. Raises LaunchError on every rank when a node differs."""
    nodes = topology.world_size // topology.ranks_per_node
    if nodes == 1:
        return
    node, local_rank = divmod(topology.rank, topology.ranks_per_node)
    save = Path(save_dir) if save_dir else None
    mine: NodeReport | None = None
    if local_rank == 0:
        mine = NodeReport(node, socket.gethostname(), "", {})
        try:  # a node that fails here still joins the gathers below, or the others would wait
            mine.code, mine.files = code_version(), data_files(data_path, tokenizer_model)
        except (MegazppError, OSError) as exc:
            mine.problem = f"cannot fingerprint its code and data: {exc}"
        if save is not None and mine.problem is None:
            mine.probe, mine.problem = _write_probe(save, node)
    reports = [r for r in comm.all_gather_object(mine, tag=TAG) if r is not None]
    # Node 0 reads every node's probe, the others read node 0's: visibility both ways.
    unseen: list[int] = []
    if mine is not None and save is not None:
        others = [r for r in reports if r.node != node and (node == 0 or r.node == 0)]
        unseen = [r.node for r in others if r.probe and not _reads_probe(save, r.probe)]
    gathered = comm.all_gather_object(unseen if mine is not None else None, tag=TAG)
    for report, not_found in zip(reports, [u for u in gathered if u is not None]):
        report.unseen = not_found
    if mine is not None and mine.probe is not None and save is not None:
        (save / mine.probe).unlink(missing_ok=True)
    problem = first_difference(reports, save_dir)
    if problem is not None:
        raise LaunchError(f"preflight: {problem}")
