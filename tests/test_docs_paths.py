"""Every file the architecture pages name exists, so a move or a rename cannot leave the map stale.

The pages (docs/architecture.md and docs/arch/*.md) name files in backticks, as written from the
checkout's root (`megazpp/zero/zero_engine.py`), from the package (`zero/options.py`), from the
page's own package (parallel.md's `tensor_parallel/layers.py`), or, in a list, by the bare name
after a path that gives the directory (`megazpp/zero/layout.py`, `bucket.py`, in one table cell).
A name is found when it exists under one of those bases; a bare name with no path before it in
its cell may be anywhere in the checkout. What a run writes (`summary.md`, `RUN/tensorboard/`) is not a file of
the checkout: only names with a source suffix, pages, and directories under the checkout's own
top-level directories are checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "architecture.md", *sorted((ROOT / "docs" / "arch").glob("*.md"))]
SOURCE = (".py", ".sh", ".yaml", ".yml", ".toml", ".sbatch")
TOP_DIRS = ("megazpp/", "kernels/", "benchmarks/", "tools/", "tests/", "configs/", "docs/", ".ci/")
# a page's own package, where its tables name modules relative to it
PAGE_PACKAGE = {"bench": "benchmarks", "kernels": "kernels", "data": "megazpp/preprocess"}
TOKEN = re.compile(r"`([\w.*/-]+)`")


def checked(token: str, page: Path) -> bool:
    """Whether `token` names a file of the checkout (as opposed to a key, a flag or an output)."""
    if token.endswith("/"):
        return token.startswith(TOP_DIRS)
    if token.endswith(".md"):
        return "/" in token or page.name == "architecture.md"
    return token.endswith(SOURCE)


def bases(page: Path) -> list[Path]:
    """The directories a name on `page` may be written from."""
    found = [ROOT, ROOT / "megazpp", ROOT / "docs", ROOT / "docs" / "arch"]
    if page.parent.name == "arch":
        found.append(ROOT / "megazpp" / page.stem)
        if page.stem in PAGE_PACKAGE:
            found.append(ROOT / PAGE_PACKAGE[page.stem])
    return found


def exists(base: Path, token: str) -> bool:
    return any(base.glob(token.rstrip("/"))) if "*" in token else (base / token).exists()


def missing_paths(page: Path, text: str | None = None) -> list[str]:
    """`page:line: token` for each file name on `page` (or in `text`, read as that page) that no
    base holds; a bare name is looked up after the paths before it in its table cell."""
    missing = []
    lines = (page.read_text() if text is None else text).splitlines()
    for number, line in enumerate(lines, 1):
        for cell in line.split("|"):  # a table's cells, or the whole line
            missing += [f"{page.relative_to(ROOT)}:{number}: {token}" for token in _missing_in(cell, page)]
    return missing


def _missing_in(cell: str, page: Path) -> list[str]:
    missing = []
    context: list[Path] = []  # the directories of the paths named earlier in the cell
    for token in TOKEN.findall(cell):
        if not checked(token, page):
            continue
        where = [*bases(page), *context]
        found = next((base / token for base in where if exists(base, token)), None)
        if found is None and "/" not in token and not context and any(ROOT.rglob(token)):
            continue
        if found is None:
            missing.append(token)
        elif "/" in token:
            context.append(found if token.endswith("/") else found.parent)
    return missing


def test_every_file_the_architecture_pages_name_exists():
    missing = [entry for page in PAGES for entry in missing_paths(page)]
    assert not missing, "files named in the architecture pages that the checkout does not have:\n" + "\n".join(missing)


def test_a_stale_name_is_found():
    """The check itself: a bare name after a path is looked up in that path's directory only
    (`engine.py` was ZeroEngine's file before it was `zero_engine.py`), and a path from the
    checkout's root must exist."""
    line = "| x | `megazpp/zero/layout.py`, `bucket.py`, `engine.py` | `tests/test_zero_engine.py`, `bench/launch.py` |"
    found = missing_paths(ROOT / "docs" / "architecture.md", line)
    assert found == ["docs/architecture.md:1: engine.py", "docs/architecture.md:1: bench/launch.py"]
