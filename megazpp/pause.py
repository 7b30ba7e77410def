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
FILE lets the process go on. Only the first arrival pauses (FILE is created once), so a point
inside a loop pauses the first pass. Unset, which is every production run, `pause_point` is a
dictionary lookup and nothing else. A malformed value is refused where the point is reached.

Points (each named where it is called):

    preprocess_file_done    preprocessing, after the first input file's shard is finished
                            (its marker written), before the next result is taken
    tokenizer_reading       tokenizer training, inside SentencePiece's reading of the lines,
                            after the first line is handed over
    evaluation              the trainer, at the start of an evaluation
    elastic_start           an elastic island, once its membership heartbeats the lighthouse,
                            before its first inner step
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megazpp.errors import ConfigError

ENV = "MEGAZPP_PAUSE_AT"
POINTS = ("preprocess_file_done", "tokenizer_reading", "evaluation", "elastic_start")
STEP_S = 0.01
_reached: set[str] = set()


def armed(point: str) -> Path | None:
    """The file the pause at `point` waits on, when `MEGAZPP_PAUSE_AT` names `point`."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    name, sep, file = spec.partition(":")
    if not sep or not file or name not in POINTS:
        raise ConfigError(f"{ENV} = {spec!r}: expected POINT:FILE with POINT one of {list(POINTS)}")
    return Path(file) if name == point else None


def pause_point(point: str) -> None:
    """Wait here while the armed file exists, the first time this process reaches `point`."""
    if point not in POINTS:
        raise ValueError(f"pause_point({point!r}): not one of {POINTS}")
    file = armed(point)
    if file is None or point in _reached:
        return
    _reached.add(point)
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, file)  # whole: a test that sees the file can read the pid
    while file.exists():
        time.sleep(STEP_S)
