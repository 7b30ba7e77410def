"""The embedded default corpus, built from text every Python installation already carries.

The project must train out of the box with no download, so the sample corpus is cut from the
running interpreter's standard library: its source files are one RedPajama "source" (code) and
the docstrings extracted from them are a second one (English prose). Output follows the
RedPajama v1 layout, one JSONL file per source, each line `{"text": ..., "meta": {...}}`.

Byte-identical output on every run is a requirement (tests and cached indices key on it), so
directories and files are walked in sorted order, nothing time- or machine-dependent goes into
a record, and JSON is written with sorted keys and fixed separators.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from megazpp.errors import DataError

CODE_SOURCE = "stdlib_code"
DOCS_SOURCE = "stdlib_docs"

# Comfortably above the 5 MB the product promises, small enough to preprocess in seconds.
DEFAULT_TOTAL_BYTES = 6_000_000

# Test suites are huge and repetitive, vendored packages are not the stdlib's own text.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"})


@dataclass(frozen=True)
class CorpusSummary:
    """What one build wrote, per source: its file, document count and size in bytes."""

    files: dict[str, Path]
    documents: dict[str, int]
    bytes: dict[str, int]


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard library (works in venvs too)."""
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_modules(root: Path) -> Iterator[tuple[str, str]]:
    """Yields (relative posix path, source text) of every UTF-8 `.py` file, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            yield path.relative_to(root).as_posix(), text


def docstrings_of(source: str, module_name: str) -> str:
    """Module, class and function docstrings of one file, as a readable plain-text document."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except SyntaxError:
        return ""
    parts = []
    module_doc = ast.get_docstring(tree)
    if module_doc:
        parts.append(f"{module_name}\n\n{module_doc}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                parts.append(f"{kind} {module_name}.{node.name}\n\n{doc}")
    return "\n\n".join(parts)


def _record(text: str, source: str, path: str) -> str:
    meta = {"language": "en" if source == DOCS_SOURCE else "Python", "path": path, "source": source}
    return json.dumps({"meta": meta, "text": text}, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def build_sample_corpus(
    out_dir: str | os.PathLike[str],
    total_bytes: int = DEFAULT_TOTAL_BYTES,
    root: Path | None = None,
    progress: bool = False,
) -> CorpusSummary:
    """Writes `<out_dir>/stdlib_code.jsonl` and `<out_dir>/stdlib_docs.jsonl`, about `total_bytes`.

    Docstrings are the scarcer source, so they get up to half of the budget and code fills the
    rest; whole records only. Tests build a tiny variant through the same code path by passing
    a small `total_bytes`. Files appear under their final name only when complete.
    """
    root = root or stdlib_dir()
    if not root.is_dir():
        raise DataError(f"standard library directory {root} does not exist; cannot build the sample corpus")
    modules = list(tqdm(iter_stdlib_modules(root), desc="reading stdlib", unit=" file", disable=not progress))
    docs_lines = _lines(
        DOCS_SOURCE, ((rel, docstrings_of(src, _module_name(rel))) for rel, src in modules), total_bytes // 2
    )
    docs_size = sum(map(len, docs_lines))
    code_lines = _lines(CODE_SOURCE, modules, total_bytes - docs_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files, documents, sizes = {}, {}, {}
    for source, lines in ((CODE_SOURCE, code_lines), (DOCS_SOURCE, docs_lines)):
        path = out / f"{source}.jsonl"
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            tmp.write_bytes(b"".join(lines))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        files[source], documents[source], sizes[source] = path, len(lines), sum(map(len, lines))
    return CorpusSummary(files=files, documents=documents, bytes=sizes)


def _module_name(rel: str) -> str:
    return rel[:-3].replace("/", ".").removesuffix(".__init__")


# Stop scanning once the budget is this close to full: the remaining texts (and, for the
# docstring source, their parsing) would cost time for at most a few small records.
_FULL_SLACK = 4096


def _lines(source: str, texts: Iterable[tuple[str, str]], budget: int) -> list[bytes]:
    """Encoded JSONL records of the non-empty texts, in order, while they fit in `budget` bytes."""
    lines, size = [], 0
    for rel, text in texts:
        if not text.strip():
            continue
        line = (_record(text, source, rel) + "\n").encode("utf-8")
        if size + len(line) > budget:
            continue
        lines.append(line)
        size += len(line)
        if budget - size < _FULL_SLACK:
            break
    return lines
