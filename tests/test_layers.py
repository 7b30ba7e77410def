"""Dependencies point down the layers of docs/architecture.md, and no modules import each other.

The layer order is written once, in the "Layers" table of docs/architecture.md (lowest first);
this test reads it, gives every Python file of the project the layer of the most specific path
in the table's "where" column that covers it, and parses every import statically (module level
and inside functions alike), so a lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import graphlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("megazpp", "kernels", "benchmarks")


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, path patterns) for each row of the Layers table, lowest layer first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def project_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return sorted(files + list((ROOT / "tools").glob("*.py")) + [ROOT / "pretrain_gpt.py"])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(path: Path, table: list[tuple[str, list[str]]]) -> int | None:
    """Index of the layer whose pattern covering `path` is longest (most specific), or None."""
    rel = path.relative_to(ROOT).as_posix()
    best: tuple[int, int] | None = None
    for index, (_, patterns) in enumerate(table):
        for pattern in patterns:
            covers = rel.startswith(pattern) if pattern.endswith("/") else fnmatch.fnmatchcase(rel, pattern)
            if covers and (best is None or len(pattern) > best[0]):
                best = (len(pattern), index)
    return None if best is None else best[1]


def imports_of(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, project module) for every import in the file, function-level ones included.
    `from pkg import name` counts as an import of `pkg.name` when that is a module."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else base))
    return [(line, name) for line, name in found if name in modules]


@functools.cache
def import_graph() -> dict[Path, list[tuple[int, str]]]:
    """Every project file's imports of project modules (parsed once for both tests)."""
    files = project_files()
    modules = {module_name(p) for p in files}
    return {p: imports_of(p, modules) for p in files}


def test_every_import_points_down_the_documented_layers():
    table = layer_table()
    names = [name for name, _ in table]
    assert len(names) >= 5 and names[0] == "errors", f"Layers table not found or reordered: {names}"
    graph = import_graph()
    files = list(graph)
    by_module = {module_name(p): p for p in files}
    unplaced = [str(p.relative_to(ROOT)) for p in files if layer_of(p, table) is None]
    assert not unplaced, f"files no row of docs/architecture.md's Layers table covers: {unplaced}"
    upward: dict[str, None] = {}  # ordered, one line per import statement
    for path in files:
        mine = layer_of(path, table)
        for line, target in graph[path]:
            theirs = layer_of(by_module[target], table)
            if theirs > mine:
                upward[f"{path.relative_to(ROOT)}:{line} ({names[mine]}) imports {target} ({names[theirs]})"] = None
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules():
    graph = {module_name(p): {t for _, t in found} - {module_name(p)} for p, found in import_graph().items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        raise AssertionError(f"modules importing each other round a loop: {' -> '.join(err.args[1])}") from err
