"""Rewrite the `tools/plan.py` examples in docs/planning.md from the tool's own output.

Why generated: the examples are what the planner prints, and output copied by hand drifted
from it as the planner learned (buffers, calls, the ranking). Each example in the page is a
marked block whose command is the source; this tool runs the command and writes what it
prints below it:

    <!-- tools/plan.py example (python tools/plan_examples.py writes its output) -->
    ```
    python tools/plan.py \\
        ARGS
    ```

    OUTPUT
    <!-- end of tools/plan.py example -->

To add an example, write the markers and the command, then run `python tools/plan_examples.py`.
`tests/test_planner_examples.py` fails, naming that command, when the page differs from what it
would write. The planner is analytic: each example takes about a second of CPU or less.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megazpp.cli import run_tool
from megazpp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOC_PATH = ROOT / "docs" / "planning.md"
BEGIN = "<!-- tools/plan.py example (python tools/plan_examples.py writes its output) -->"
END = "<!-- end of tools/plan.py example -->"
_BLOCK = re.compile(
    re.escape(BEGIN) + r"\n```\npython tools/plan\.py \\\n(?P<args>[^`]*?)\n```\n(?P<output>.*?)" + re.escape(END), re.S
)


@dataclass(frozen=True)
class Example:
    """One marked block: the tool's arguments and the output the page shows for them."""

    args: list[str]
    shown: str
    span: tuple[int, int]  # of the output in the page's text


def examples(text: str) -> list[Example]:
    """The marked blocks of `text`, in order; a begin marker without a well-formed block is an error."""
    found = [
        Example(shlex.split(m["args"].replace("\\\n", " ")), m["output"], m.span("output"))
        for m in _BLOCK.finditer(text)
    ]
    if len(found) != text.count(BEGIN):
        raise ConfigError(
            f"{DOC_PATH.name}: a '{BEGIN}' marker is not followed by a ```python tools/plan.py "
            f"\\ ...``` block and '{END}'"
        )
    return found


@functools.cache
def _plan_main() -> Callable[[list[str] | None], int]:
    """tools/plan.py's `main` (a script, not a module of the package), loaded once."""
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROOT / 'tools' / 'plan.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main: Callable[[list[str] | None], int] = module.main
    return main


def output_of(args: list[str]) -> str:
    """What `python tools/plan.py ARGS` prints, framed as the page shows it (blank lines around)."""
    main, out = _plan_main(), io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    if code:
        raise ConfigError(f"{DOC_PATH.name}: python tools/plan.py {shlex.join(args)} exited with {code}")
    return "\n" + out.getvalue().rstrip("\n") + "\n\n"


def render(text: str) -> str:
    """`text` with every example's output replaced by the tool's current output."""
    pieces, last = [], 0
    for example in examples(text):
        lo, hi = example.span
        pieces += [text[last:lo], output_of(example.args)]
        last = hi
    return "".join(pieces) + text[last:]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    DOC_PATH.write_text(render(DOC_PATH.read_text()))
    print(f"wrote {DOC_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_tool(main)
