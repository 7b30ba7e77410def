"""Which code a device check ran: the commit when the project root is a git checkout's top
level, else a fingerprint of the project's source files that a commit can be matched against.

Why: the device machine receives a copy of the working tree, sometimes inside another
repository; `git rev-parse HEAD` there names that surrounding repository's commit, which says
nothing about this project. So the report names a commit only when the project root is a git
top level (adding that the tree differs from it, when it does), and always gives the
fingerprint: sha256 over the sorted source files' paths and contents (`SOURCE_DIRS`,
`SOURCE_FILES`, `SOURCE_SUFFIXES`), read from the files on disk or from a commit's blobs by one
function, so the same number comes out of both:

    python3 -m benchmarks.gpu_check.provenance              # this tree's fingerprint
    python3 -m benchmarks.gpu_check.provenance --commit REV # REV's, to match a report
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

SOURCE_DIRS = ("megazpp", "benchmarks", "kernels", "tools", "tests", "configs")
SOURCE_FILES = ("pretrain_gpt.py", "run.sh", "pyproject.toml")
SOURCE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".json", ".toml", ".sbatch")


def is_source(path: str) -> bool:
    """A path (relative, '/'-separated) that the fingerprint covers."""
    parts = path.split("/")
    if "__pycache__" in parts:
        return False
    if len(parts) == 1:
        return path in SOURCE_FILES
    return parts[0] in SOURCE_DIRS and path.endswith(SOURCE_SUFFIXES)


def fingerprint(files: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over (path, content) of the source files among `files`, in path order."""
    digest = hashlib.sha256()
    for path, content in sorted((p, c) for p, c in files if is_source(p)):
        digest.update(f"{path}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def tree_files(root: Path) -> Iterator[tuple[str, bytes]]:
    """The source files under `root` as they are on disk (links to files followed)."""
    found = [root / name for name in SOURCE_FILES] + [p for d in SOURCE_DIRS for p in (root / d).rglob("*")]
    for path in found:
        rel = path.relative_to(root).as_posix()
        if is_source(rel) and path.is_file():
            yield rel, path.read_bytes()


def commit_files(root: Path, commit: str) -> Iterator[tuple[str, bytes]]:
    """The files of `commit` of the repository whose top level is `root`."""
    listing = _git(root, "ls-tree", "-r", "-z", commit).decode()
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        kind, blob = meta.split()[1:3]
        if kind == "blob" and is_source(path):
            yield path, _git(root, "cat-file", "blob", blob)


def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout


def git_top_level(root: Path) -> bool:
    """Whether `root` is the top level of a git work tree (not a copy inside another one)."""
    proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == root.resolve()


@functools.cache
def describe(root: Path) -> str:
    """The report's sentence on which code ran (once per run: the report is rewritten after
    every step)."""
    mark = f"source fingerprint {fingerprint(tree_files(root))[:16]}"
    how = "python3 -m benchmarks.gpu_check.provenance --commit REV gives a commit's"
    if not git_top_level(root):
        return f"{mark} (the project root is no git checkout's top level: a copied tree, so no commit is named; {how})"
    commit = _git(root, "rev-parse", "--short", "HEAD").decode().strip()
    changed = fingerprint(commit_files(root, "HEAD")) != fingerprint(tree_files(root))
    return f"commit {commit}{' with uncommitted changes' if changed else ''}; {mark} ({how})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="print the source fingerprint a device check's report gives")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--commit", help="fingerprint this commit's files instead of the tree on disk")
    args = parser.parse_args(argv)
    files = commit_files(args.root, args.commit) if args.commit else tree_files(args.root)
    print(fingerprint(files)[:16])


if __name__ == "__main__":
    main()
