"""Named pause points: a process stops at a known place and waits, so a test can interrupt,
signal or kill it there and not a moment too late.

Why in the product code: a test that sends Ctrl-C "during preprocessing" and watches for
progress races the tool; on a loaded machine the tool can finish first (it did, on 2 shared
cores: `preprocessed 8 files ... in 1.4 s`, then `assert 0 == 130`). A pause point makes the
moment part of the run: the process reaches it, says so, and waits there until the test has
done what it came for.

The environment variable `MEGAZPP_PAUSE_AT=POINT:FILE` arms one point. When the process
reaches `pause_point(POINT)` it creates FILE (holding its pid) and then waits while FILE
exists, sleeping in short steps: a signal is handled in the wait as anywhere else (Ctrl-C
raises KeyboardInterrupt there, the trainer's handler records a stop request), and removing
FILE lets the process go on. In FILE, `{rank}` stands for the process's torchrun RANK (0
without one), so each rank of a job pauses on a file of its own and a test knows when all of
them arrived (one shared file would be released while a late rank had not yet come to it, and
that rank would then wait on it alone). Only one arrival pauses (FILE is created once): the first, or with
`POINT@N:FILE` the N-th, so a point inside a loop pauses one chosen pass (an elastic island
held at its 4th outer sync, after its 3rd). Unset, which is every production run,
`pause_point` is a dictionary lookup and nothing else. A malformed value is refused where the
point is reached.

Points (each named where it is called):

    preprocess_file_done    preprocessing, after the first input file's shard is finished
                            (its marker written), before the next result is taken
    tokenizer_reading       tokenizer training, inside SentencePiece's reading of the lines,
                            after the first line is handed over
    evaluation              the trainer, at the start of an evaluation
    elastic_start           an elastic island, once its membership heartbeats the lighthouse,
                            before its first inner step
    elastic_sync            an elastic island, at an outer sync, after the interval's last
                            inner step, before its quorum request
    elastic_join            an elastic island that starts at an interval's boundary (new, or
                            resumed at a sync), before the quorum request of its start exchange
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megazpp.errors import ConfigError

ENV = "MEGAZPP_PAUSE_AT"
POINTS = ("preprocess_file_done", "tokenizer_reading", "evaluation", "elastic_start", "elastic_sync", "elastic_join")
STEP_S = 0.01
_arrivals: dict[str, int] = {}


def armed(point: str) -> tuple[Path, int] | None:
    """The file the pause at `point` waits on and the arrival that pauses (1 = the first), when
    `MEGAZPP_PAUSE_AT` names `point`."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    where, sep, file = spec.partition(":")
    name, at, nth = where.partition("@")
    if not sep or not file or name not in POINTS or (at and not (nth.isdigit() and int(nth) >= 1)):
        raise ConfigError(
            f"{ENV} = {spec!r}: expected POINT:FILE or POINT@N:FILE (N >= 1) with POINT one of {list(POINTS)}"
        )
    if name != point:
        return None
    return Path(file.replace("{rank}", os.environ.get("RANK", "0"))), int(nth) if at else 1


def pause_point(point: str) -> None:
    """Wait here while the armed file exists, at the armed arrival of this process at `point`."""
    if point not in POINTS:
        raise ValueError(f"pause_point({point!r}): not one of {POINTS}")
    spec = armed(point)
    if spec is None:
        return
    file, nth = spec
    _arrivals[point] = _arrivals.get(point, 0) + 1
    if _arrivals[point] != nth:
        return
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, file)  # whole: a test that sees the file can read the pid
    while file.exists():
        time.sleep(STEP_S)
