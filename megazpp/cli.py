"""How a command-line program of the project starts and ends.

It starts with logging configured once (`configure_logging`): megazpp's INFO records, such as
the ZeRO engine's layout or the planner's pick for `paro_strategy: auto`, are lines a user
should see. It ends with a refusal of user input (`MegazppError`: bad file, key, value), the
user's to fix, printed as one `prog: error: ...` line with exit code 2, like argparse's own
errors, instead of a traceback; anything else is a bug and keeps its traceback. Ctrl-C
(SIGINT, a KeyboardInterrupt) is the user's choice, not a fault: one `prog: interrupted
(SIGINT)` line, with what was kept when the tool says so (the KeyboardInterrupt's message),
and exit code 130 (128 + SIGINT, as a shell reports it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

from megazpp.errors import ConfigError, MegazppError


class _ConsoleHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever sys.stdout / sys.stderr is when a record comes (a run inside a test
    or a tool that redirects them gets its lines where its prints go)."""

    def __init__(self, to_stdout: bool) -> None:
        super().__init__()
        self.to_stdout = to_stdout
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> TextIO:
        return sys.stdout if self.to_stdout else sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(rank: int, *, to_stdout: bool = False) -> None:
    """Rank 0 prints megazpp's INFO records, other ranks only warnings: to stderr for a tool
    (its stdout is its output), to stdout for the training job (whose log is stdout). Called
    again (the job, once it knows its rank), it replaces the earlier setting."""
    root = logging.getLogger("megazpp")
    for handler in [h for h in root.handlers if isinstance(h, _ConsoleHandler)]:
        root.removeHandler(handler)
    root.addHandler(_ConsoleHandler(to_stdout))
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def run_tool(main: Callable[[], object], prog: str | None = None) -> NoReturn:
    """Run `main` with logging configured (this process's rank from torchrun's RANK, else 0);
    an int `main` returns is the exit code, anything else (a run's history) is 0. `prog` names
    the program in the error line (default: the script's file name)."""
    configure_logging(int(os.environ.get("RANK", "0")))
    name = prog or os.path.basename(sys.argv[0])
    try:
        result = main()
    except MegazppError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        # the cleanup ran on the way up (finally / except blocks); a second Ctrl-C while this
        # line is printed must not add the traceback back
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"{name}: interrupted (SIGINT){f': {exc}' if str(exc) else ''}", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    sys.exit(result if isinstance(result, int) else 0)


class _Renamed(argparse.Action):
    """A spelling a tool used before the tools spoke one dialect: stop with the one to use."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[str] | None,
        option_string: str | None = None,
    ) -> None:
        raise ConfigError(f"{option_string} is spelled {self.new} now (the name pretrain_gpt.py and every tool use)")


def add_renamed_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str) -> None:
    """Refuse `old` naming `new`, rather than leave it to argparse's prefix matching (which
    would take `--hidden` for `--hidden-size` in one tool and refuse it in another)."""
    parser.add_argument(old, action=_Renamed, new=new)


def add_out_flag(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    """Where a tool writes its results: `--out` (`kwargs` as for add_argument) in every tool,
    `--output` refused with it."""
    parser.add_argument("--out", **kwargs)
    add_renamed_flag(parser, "--output", "--out")


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (bars are drawn only when stderr is a terminal)"
    )


def wants_progress(args: argparse.Namespace) -> bool:
    """A progress bar redraws its line with carriage returns: right on a terminal, noise in a
    log file (run.sh's, a batch job's), so bars need a terminal as well as no --no-progress."""
    return not args.no_progress and sys.stderr.isatty()
