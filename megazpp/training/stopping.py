"""Stopping a run early and cleanly: SIGTERM, SIGINT and `--exit-duration-in-mins`.

Why: schedulers send SIGTERM some seconds before SIGKILL (preemption, the end of a time
slot) and users press Ctrl-C; without a handler the first kills the process with no
checkpoint and the second ends in a traceback. The handler only records the request: the
trainer finishes the step it is in, the ranks agree (a signal reaches them at different
moments, possibly in different steps), and every rank stops after the same step, saving
first when `--save` is set. A second signal exits at once, without saving. One that comes
within a second of the first is taken as the same request: a rank can receive a scheduler's
signal both directly and forwarded by its launcher.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType, TracebackType

# `--exit-duration-in-mins` counts from here, i.e. from the start of the program (this module
# is imported with the trainer), setup included, as Megatron counts: a scheduler's time limit
# does not pause for data and model building either.
PROGRAM_START = time.monotonic()
SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAME_REQUEST_S = 1.0
# What each rank contributes to the agreement (a MAX over ranks): the larger code wins.
NO_STOP, DURATION, SIGNAL = 0, 1, 2


def _say(text: str) -> None:
    """One line on stderr from global rank 0 only (every rank receives a forwarded signal).
    `os.write`, not `print`: a handler can interrupt a print in progress."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{text}\n".encode())


class StopRequests:
    """While active (a `with` block in the main thread), SIGTERM and SIGINT request a stop
    instead of ending the process; `code()` says whether this rank wants to stop and why."""

    def __init__(self, exit_duration_mins: float | None) -> None:
        self.signal_name: str | None = None
        self._first_signal_at = 0.0
        self._deadline = PROGRAM_START + 60.0 * exit_duration_mins if exit_duration_mins is not None else None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # where Python runs handlers
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]  # what signal() returned
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signal_name is None:
            self.signal_name, self._first_signal_at = name, now
            _say(
                f"{name} received: finishing this step, then saving (when --save is set) and "
                f"stopping; send it again to exit at once"
            )
        elif now - self._first_signal_at >= SAME_REQUEST_S:
            _say(f"second {name} received: exiting at once, without saving")
            os._exit(128 + signum)

    def code(self) -> int:
        """SIGNAL, DURATION or NO_STOP for this rank, now."""
        if self.signal_name is not None:
            return SIGNAL
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return DURATION
        return NO_STOP
