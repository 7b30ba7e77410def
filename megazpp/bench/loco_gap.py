"""How much of int4's loss gap LoCo closes: `python -m megazpp.bench.loco_gap FP32 INT4 LOCO`.

The LoCo paper's claim, as the experiment tests it: with g = final loss, closed =
(g(int4) - g(int4 + LoCo)) / (g(int4) - g(fp32)); the target is closed >= 0.5. Computed for
the training loss (the interval mean at the last common step, what compare_runs reports) and
the validation loss (the same held-out batches every time, so the less noisy of the two).
When int4 is not worse than fp32 there is no gap to close, and the line says so instead of
dividing by a non-positive number. Optionally written to a Markdown file next to the plots.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from megazpp.analysis.comparison import compare_runs
from megazpp.analysis.event_reader import read_run
from megazpp.errors import MegazppError

TARGET = 0.5


def closed_fraction(fp32: float, int4: float, loco: float) -> float | None:
    """Share of int4's gap to fp32 that LoCo removes; None when int4 has no gap."""
    gap = int4 - fp32
    if not gap > 0:
        return None
    return (int4 - loco) / gap


def describe(kind: str, fp32: float | None, int4: float | None, loco: float | None) -> str:
    if None in (fp32, int4, loco):
        return f"{kind}: n/a (a run lacks this loss)"
    closed = closed_fraction(fp32, int4, loco)
    losses = f"fp32 {fp32:.4f}, int4 {int4:.4f}, int4+LoCo {loco:.4f}"
    if closed is None:
        return f"{kind}: {losses}; int4 is not worse than fp32, so there is no gap to close"
    verdict = "meets" if closed >= TARGET else "misses"
    return (f"{kind}: {losses}; int4 gap {int4 - fp32:+.4f}, LoCo gap {loco - fp32:+.4f}: "
            f"LoCo closes {100 * closed:.0f}% of the gap ({verdict} the >= {100 * TARGET:.0f}% target)")


def report(run_dirs: Sequence[str]) -> list[str]:
    comparison = compare_runs([read_run(d, name) for d, name in zip(run_dirs, ("fp32", "int4", "int4+loco"))])
    s = comparison.summaries
    lines = [describe("final train loss", *(r.final_loss for r in s)),
             describe("final validation loss", *(r.final_val_loss for r in s))]
    if comparison.step_range:
        lines.append(f"(over the common steps {comparison.step_range[0]}..{comparison.step_range[1]})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fp32"), p.add_argument("int4"), p.add_argument("loco")
    p.add_argument("--out", help="also write these lines to this Markdown file")
    ns = p.parse_args(argv)
    try:
        lines = report([ns.fp32, ns.int4, ns.loco])
    except MegazppError as exc:
        print(f"loco_gap: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if ns.out:
        tmp = f"{ns.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("# LoCo experiment: gap closed\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
        os.replace(tmp, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
