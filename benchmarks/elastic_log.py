"""What an elastic benchmark's logs say (tools/bench_elastic.py): its numbers come only from here.

Why from the logs and not from the processes: the islands are separate jobs killed at will, so
the only record that survives a kill is what each wrote. The benchmark stamps every line with
the seconds since its start as it reads it (`[  12.345] line`), and writes its own kills and
restarts in the same clock (`events.log`), so a test can recompute every number from the files.

Useful inner steps: an elastic job's are the inner steps merged at a sync (the tokens of each
island in the sync's line, over the tokens of one inner step: a healed island's stale interval
and a killed island's unfinished one weigh nothing); the synchronous job's are every island's
steps up to its last outer sync (a failure restarts it from its checkpoint, which the benchmark
saves at each sync, so steps past the last sync are redone). Their share of the inner steps
trained in the window (every iteration line, merged or not) is the failures' waste measured
inside one run, whatever the machine's load did between runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megazpp.errors import DataError

STAMPED = re.compile(r"^\[\s*(\d+\.\d+)\] (.*)$")
SYNC = re.compile(r"outer: island (\d+), outer sync (\d+) at step \d+: islands (\d+(?:,\d+)*), tokens (\d+(?:,\d+)*)")
DROP = re.compile(r"outer: island (\d+) dropped at outer sync (\d+)")
REJOIN = re.compile(r"outer: island (\d+) rejoined at outer sync (\d+)")
ITERATION = re.compile(r"^\s*iter\s+(\d+)/\d+ \| loss ")
EVENT = re.compile(r"^(kill|restart) island (\d+) (\S+)$")  # events.log: what the benchmark did


@dataclass(frozen=True)
class Line:
    t: float  # seconds since the benchmark's start when the line was read
    text: str


@dataclass(frozen=True)
class Sync:
    """One committed outer sync of an elastic job, at the first time an island logged it."""

    number: int
    t: float
    islands: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Event:
    """A kill or restart the benchmark did: the island, and the log its (new) process writes."""

    t: float
    kind: str
    island: int
    log: str


def stamp(t: float, text: str) -> str:
    return f"[{t:10.3f}] {text}"


def read(path: str | Path) -> list[Line]:
    """A stamped log's lines (an unstamped line, e.g. one cut by a kill, is left out)."""
    lines = []
    for raw in Path(path).read_text(errors="replace").splitlines():
        m = STAMPED.match(raw)
        if m:
            lines.append(Line(float(m.group(1)), m.group(2)))
    return lines


def events(path: str | Path) -> list[Event]:
    found = []
    for line in read(path):
        m = EVENT.match(line.text)
        if m is None:
            raise DataError(f"{path}: unexpected line {line.text!r} (expected 'kill|restart island N LOG')")
        found.append(Event(line.t, m.group(1), int(m.group(2)), m.group(3)))
    return found


def syncs(logs: Iterable[Sequence[Line]]) -> dict[int, Sync]:
    """Every outer sync any island logged, by number; every island in a sync logs the same
    members and tokens, and a disagreement is refused (the logs are not one job's)."""
    found: dict[int, Sync] = {}
    for lines in logs:
        for line in lines:
            m = SYNC.search(line.text)
            if m is None:
                continue
            number = int(m.group(2))
            islands = tuple(int(i) for i in m.group(3).split(","))
            tokens = tuple(int(n) for n in m.group(4).split(","))
            seen = found.get(number)
            if seen is not None and (seen.islands, seen.tokens) != (islands, tokens):
                raise DataError(
                    f"outer sync {number} is logged with islands {islands} tokens {tokens} and with "
                    f"islands {seen.islands} tokens {seen.tokens}: not one job's logs"
                )
            if seen is None or line.t < seen.t:
                found[number] = Sync(number, line.t, islands, tokens)
    return dict(sorted(found.items()))


def merged_steps(found: dict[int, Sync], start: float, end: float, tokens_per_step: int) -> float:
    """Inner steps merged by the syncs committed in (start, end]: their tokens over one step's."""
    tokens = sum(sum(s.tokens) for s in found.values() if start < s.t <= end)
    return tokens / tokens_per_step


def trained_steps(lines: Sequence[Line], start: float, end: float) -> int:
    """Inner steps a log's iteration lines say were trained in (start, end] (merged or not)."""
    return sum(1 for line in lines if start < line.t <= end and ITERATION.match(line.text))


def first_after(lines: Sequence[Line], pattern: re.Pattern[str], island: int, t: float) -> float | None:
    """When `pattern` (its first group the island) was first logged for `island` after `t`."""
    for line in lines:
        m = pattern.search(line.text)
        if line.t > t and m is not None and int(m.group(1)) == island:
            return line.t
    return None


def detect_times(kills: Sequence[Event], logs: Mapping[str, Sequence[Line]], end: float) -> list[float | None]:
    """Per kill: seconds until another island's sync dropped the killed one (None: not by `end`)."""
    out: list[float | None] = []
    for kill in kills:
        seen = [first_after(lines, DROP, kill.island, kill.t) for name, lines in logs.items() if name != kill.log]
        first = min((t for t in seen if t is not None and t <= end), default=None)
        out.append(None if first is None else first - kill.t)
    return out


def rejoin_times(restarts: Sequence[Event], logs: Mapping[str, Sequence[Line]], end: float) -> list[float | None]:
    """Per restart: seconds until the restarted island logged the sync it healed in (None: not by `end`)."""
    out: list[float | None] = []
    for restart in restarts:
        t = first_after(logs[restart.log], REJOIN, restart.island, restart.t)
        out.append(None if t is None or t > end else t - restart.t)
    return out


def sync_steps(lines: Sequence[Line], sync_every: int) -> list[tuple[float, int]]:
    """(time, step) of the synchronous job's iteration lines at its outer syncs (steps k x H)."""
    out = []
    for line in lines:
        m = ITERATION.match(line.text)
        if m and int(m.group(1)) % sync_every == 0:
            out.append((line.t, int(m.group(1))))
    return out


def reached(steps: Sequence[tuple[float, int]], t: float) -> int:
    """The furthest outer-sync step logged by time `t` (0 before any)."""
    return max((step for when, step in steps if when <= t), default=0)


def back_times(kills: Sequence[Event], steps: Sequence[tuple[float, int]], end: float) -> list[float | None]:
    """Per kill of the synchronous job: seconds until it logged an outer sync past the furthest
    it had reached at the kill (the restart, the reload and the redone steps; None: not by `end`)."""
    out: list[float | None] = []
    for kill in kills:
        was = reached(steps, kill.t)
        later = [when for when, step in steps if when > kill.t and step > was and when <= end]
        out.append(min(later) - kill.t if later else None)
    return out
