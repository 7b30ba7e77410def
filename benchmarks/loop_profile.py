"""Where the training loop's host time goes, phase by phase: `pretrain_gpt.main` under cProfile.

Why: `run.sh --bf16` reached 90% of the bare step's tokens/s on an H200 (issue 40), and the
bare step (tools/bench_model.py: forward, backward, fused AdamW on the model's own weights)
leaves out both the engine's precision work (fp32 gradient accumulation, grad norm and clip,
fp32 master update and copy back) and the loop's bookkeeping (data, loss logging, numerics,
stop agreement). This splits the loop's wall time by the functions that do each, so the
overhead has names before anything is removed. A phase that waits for the device (a
`float()` of a device tensor: the grad norm, the logged loss) absorbs the queued device work
it waits for, so on a GPU "engine step" includes the tail of the backward pass.

    python tools/profile_loop.py --data-path P --tokenizer-model T --bf16 ...  (pretrain_gpt flags)

The tool runs `python -m cProfile -o STATS pretrain_gpt.py FLAGS` as one process (one rank,
what tools/gpu_check.sh's end-to-end step compares with the bare step) and reads STATS here.
"""

from __future__ import annotations

import pstats
from dataclasses import dataclass

# (phase, path suffix of the defining file, function name); top-level phases do not nest in
# one another, so their times add up within the loop; `PARTS` nest inside a phase.
PHASES = (
    ("data: samples to a micro-batch", "megazpp/training/trainer.py", "make_micro_batch"),
    ("forward + backward", "megazpp/training/forward_backward.py", "forward_backward"),
    ("engine step (local)", "megazpp/optim/local_engine.py", "step"),
    ("engine step (ZeRO)", "megazpp/zero/zero_engine.py", "step"),
    ("loss mean over DP ranks (host sync)", "megazpp/training/trainer.py", "_dp_mean"),
    ("logging", "megazpp/training/logger.py", "record_step"),
    ("logging", "megazpp/training/logger.py", "write_scalars"),
    ("numerics check", "megazpp/training/trainer.py", "_check_numerics"),
    ("stop agreement across ranks", "megazpp/training/trainer.py", "_agreed_stop"),
)
PARTS = (
    ("  of which fp32 gradient accumulation hooks", "megazpp/optim/local_engine.py", "hook"),
    ("  of which grad norm (host sync)", "megazpp/optim/grad_norm.py", "global_grad_norm"),
    ("  of which clipping", "megazpp/optim/grad_norm.py", "clip_by_norm_"),
    ("  of which the optimizer update", "torch/optim/adam.py", "step"),
    ("  of which zero_grad", "megazpp/optim/local_engine.py", "zero_grad"),
)
LOOP = ("megazpp/training/trainer.py", "_train")


@dataclass
class LoopProfile:
    """Seconds per phase over the run's loop, and the loop's own total and step count."""

    loop_s: float
    steps: int
    phases: dict[str, float]

    def table(self) -> str:
        """Markdown: each phase's milliseconds per step and share of the loop."""
        per = 1e3 / max(self.steps, 1)
        rows = ["| phase | ms per step | % of the loop |", "|---|---:|---:|"]
        for name, seconds in self.phases.items():
            rows.append(f"| {name} | {seconds * per:.2f} | {100 * seconds / self.loop_s:.1f}% |")
        rows.append(f"| loop ({self.steps} steps) | {self.loop_s * per:.2f} | 100% |")
        return "\n".join(rows)


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[float, int]:
    """(cumulative seconds, primitive calls) of the functions `name` defined in a file ending
    in `suffix` (Python 3.11 pstats: {(file, line, name): (cc, nc, tt, ct, callers)})."""
    total, calls = 0.0, 0
    for (file, _, func), (cc, _, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and file.replace("\\", "/").endswith(suffix):
            total, calls = total + ct, calls + cc
    return total, calls


def loop_profile(stats: pstats.Stats) -> LoopProfile:
    """Split the training loop's time in a cProfile of a training job into phases."""
    loop_s, _ = _cumulative(stats, *LOOP)
    steps = sum(
        _cumulative(stats, suffix, name)[1] for label, suffix, name in PHASES if label.startswith("engine step")
    )
    phases: dict[str, float] = {}
    for label, suffix, name in PHASES + PARTS:
        seconds, _ = _cumulative(stats, suffix, name)
        if seconds:
            phases[label] = phases.get(label, 0.0) + seconds
    top = sum(s for label, s in phases.items() if not label.startswith("  "))
    phases["rest of the loop (sampler, lr, counters, clock)"] = max(0.0, loop_s - top)
    return LoopProfile(loop_s, steps, phases)
