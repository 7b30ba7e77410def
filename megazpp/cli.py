"""The one way a command-line tool ends.

A refusal of user input (`MegazppError`: bad file, key, value) is the user's to fix, so it is
printed as one `prog: error: ...` line with exit code 2, like argparse's own errors, instead of a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, NoReturn

from megazpp.errors import MegazppError


def run_tool(main: Callable[[], Any], prog: str | None = None) -> NoReturn:
    """Run `main`; an int it returns is the exit code, anything else (a run's history) is 0.
    `prog` names the program in the error line (default: the script's file name)."""
    try:
        result = main()
    except MegazppError as exc:
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(result if isinstance(result, int) else 0)


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (bars are drawn only when stderr is a terminal)")


def wants_progress(args: argparse.Namespace) -> bool:
    """A progress bar redraws its line with carriage returns: right on a terminal, noise in a
    log file (run.sh's, a batch job's), so bars need a terminal as well as no --no-progress."""
    return not args.no_progress and sys.stderr.isatty()
