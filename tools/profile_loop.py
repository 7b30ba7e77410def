"""The training loop's time per phase (benchmarks/loop_profile.py) for one pretrain_gpt job.

    python tools/profile_loop.py [--stats FILE] -- PRETRAIN_GPT_FLAGS
    python tools/profile_loop.py -- --data-path data/corpus_text_document \\
        --tokenizer-model data/tokenizer.model --bf16 --num-layers 2 --hidden-size 64 --train-iters 200

Runs `python -m cProfile -o STATS pretrain_gpt.py FLAGS` (one rank) and prints a Markdown table:
milliseconds per step and share of the loop of each phase (data, forward + backward, the
engine step and its parts, logging, numerics, the rest).
"""

from __future__ import annotations

import argparse
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)

from benchmarks.loop_profile import loop_profile
from megazpp.cli import run_tool

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stats", help="keep the cProfile stats here (default: a temporary file)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="pretrain_gpt.py flags, after --")
    args = parser.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    with tempfile.TemporaryDirectory() as tmp:
        stats = args.stats or str(Path(tmp) / "loop.prof")
        cmd = [sys.executable, "-m", "cProfile", "-o", stats, str(ROOT / "pretrain_gpt.py"), *flags]
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            raise SystemExit(f"profile_loop: pretrain_gpt.py exited {rc}")
        print(loop_profile(pstats.Stats(stats)).table())


if __name__ == "__main__":
    run_tool(main)
