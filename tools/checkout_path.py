"""Puts this checkout first on `sys.path`, for the tools that import `benchmarks`.

Why: the benchmark harness (`benchmarks/`) is not part of the installed package (pyproject's
package list names only `megazpp` and `kernels`), and `python tools/X.py` puts only `tools/` on
the path, so without this a benchmark tool finds `benchmarks` only when PYTHONPATH names the
checkout (which `sudo` drops). First on the path, so the harness and the `megazpp` it measures
come from the same checkout. A tool imports this module before any of the project's.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)
