"""Input files as shards of one preprocessing run: names, sources, and resume markers.

Each input file becomes one shard with its own `.bin/.idx` per output under
`<output-prefix>_shards/<name>...`. When a shard's outputs are complete and renamed into place,
a marker `<name>.done.json` records what went in (the input files' sizes and mtimes and a
fingerprint of every option that changes the tokens) and what came out (outputs and counts).
A rerun trusts exactly the shards whose marker matches and redoes the rest, so an interrupted
run of thousands of files loses at most the shards that were in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from megazpp.errors import DataError
from megazpp.preprocess.jsonl import strip_jsonl_suffix
from megazpp.preprocess.redpajama_v2 import V2Files, v2_files

MARKER_SUFFIX = ".done.json"
MARKER_VERSION = 1


@dataclass(frozen=True)
class Shard:
    path: Path
    name: str  # path relative to the input root, JSONL suffix removed
    source: str  # the source directory, for --split-by-source when a record names none
    v2: V2Files | None


def safe_name(text: str) -> str:
    """A source name usable inside a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "unnamed"


def plan_shards(files: list[Path], root: Path) -> list[Shard]:
    """One shard per file. The source of a file is the top directory under the input root that
    holds it (a RedPajama-V2 file: its snapshot under `documents/`), or for a file directly in
    the root its own name: RedPajama-1T's `arxiv/`, `c4/`, ... directories become sources."""
    shards: list[Shard] = []
    seen: dict[str, Path] = {}
    for path in files:
        try:
            relative = path.resolve().relative_to(root.resolve())
        except ValueError:
            relative = Path(path.name)
        name = strip_jsonl_suffix(relative.as_posix())
        if name in seen:
            raise DataError(f"inputs {seen[name]} and {path} would both write shard {name!r}; keep one of them")
        seen[name] = path
        v2 = v2_files(path)
        source = v2.snapshot if v2 else (relative.parts[0] if len(relative.parts) > 1 else name)
        shards.append(Shard(path=path, name=name, source=safe_name(source), v2=v2))
    return shards


def file_identity(paths: list[Path]) -> list[list[object]]:
    """What decides whether an input changed since its shard was made."""
    out: list[list[object]] = []
    for p in paths:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def options_fingerprint(tokenizer_model: Path, options: dict[str, object]) -> str:
    """Hash of the tokenizer model's bytes and of every option that changes a shard's output."""
    digest = hashlib.sha256(tokenizer_model.read_bytes())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()


@dataclass(kw_only=True)
class DocumentCounts:
    """What preprocessing counts, per output label or per rule: one shard's, or a whole run's
    (the sum of its shards')."""

    documents: Counter[str] = field(default_factory=Counter)
    tokens: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> documents
    dropped: Counter[str] = field(default_factory=Counter)  # filter rule -> documents
    unevaluable: Counter[str] = field(default_factory=Counter)  # filter rule -> documents missing a signal
    damage: list[str] = field(default_factory=list)  # one line per damaged input file

    def add_counts(self, other: DocumentCounts) -> None:
        for counts, more in (
            (self.documents, other.documents),
            (self.tokens, other.tokens),
            (self.skipped, other.skipped),
            (self.dropped, other.dropped),
            (self.unevaluable, other.unevaluable),
        ):
            counts.update(more)
        self.damage.extend(other.damage)


@dataclass(kw_only=True)
class ShardResult(DocumentCounts):
    """What one shard produced; labels name outputs (`text`, or `<source>:text` split by source)."""

    outputs: dict[str, str] = field(default_factory=dict)


def marker_path(shard_dir: Path, shard: Shard) -> Path:
    return shard_dir / f"{shard.name}{MARKER_SUFFIX}"


def read_marker(path: Path, identity: list[list[object]], fingerprint: str) -> ShardResult | None:
    """The recorded result if the marker matches these inputs and options and its outputs exist."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (
        not isinstance(data, dict)
        or data.get("version") != MARKER_VERSION
        or data.get("inputs") != identity
        or data.get("fingerprint") != fingerprint
    ):
        return None
    result = ShardResult(
        outputs=data["outputs"],
        damage=data["damage"],
        **{k: Counter(data[k]) for k in ("documents", "tokens", "skipped", "dropped", "unevaluable")},
    )
    if not all(Path(f"{p}{s}").is_file() for p in result.outputs.values() for s in (".bin", ".idx")):
        return None
    return result


def write_marker(path: Path, identity: list[list[object]], fingerprint: str, result: ShardResult) -> None:
    """Written last, atomically: a marker on disk means the shard's outputs are complete."""
    # not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs
    data = {
        "version": MARKER_VERSION,
        "inputs": identity,
        "fingerprint": fingerprint,
        **{f.name: getattr(result, f.name) for f in fields(result)},
    }
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
