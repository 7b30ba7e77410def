"""Per-interval training metrics: one console line and the same numbers in TensorBoard.

Lines are emitted every `log_interval` steps, plus after the first step (the starting loss a
run is judged against) and the last.

Why averaged over the log interval rather than per step: the console line and the
TensorBoard point then show exactly the same values, and tokens/s over an interval is not
dominated by one slow step. Tags (fixed, compared across runs and frameworks):

    train/loss          mean loss over the interval's steps (all data-parallel ranks)
    val/loss            mean validation loss at each evaluation
    train/lr            learning rate of the interval's last step
    train/grad_norm     mean global gradient norm (before clipping) over applied steps
    train/loss_scale    fp16 loss scale after the interval's last step (1 otherwise)
    train/skipped_steps steps of the interval whose update was skipped (fp16 overflow, NaN)
    perf/tokens_per_sec tokens of all ranks per second of wall time
    perf/tflops         achieved model TFLOP/s per rank: training FLOPs / time / world size
    mem/peak_bytes      peak accelerator memory allocated (CUDA) or peak resident set size (CPU)

Written by the trainer when it happens (not at the interval): `train/loss_spike`, the
ratio of a spiking loss to the recent mean (see `numerics.NumericsMonitor`).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Mapping

import torch

from megazpp.optim.engine_protocol import StepResult

TAGS = (
    "train/loss",
    "val/loss",
    "train/lr",
    "train/grad_norm",
    "train/loss_scale",
    "train/skipped_steps",
    "perf/tokens_per_sec",
    "perf/tflops",
    "mem/peak_bytes",
)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class TrainingLogger:
    """Collects step results; emits on the logging rank (others only keep the clock)."""

    def __init__(
        self,
        *,
        enabled: bool,
        tensorboard_dir: str | None,
        log_interval: int,
        train_iters: int,
        tokens_per_step: int,
        flops_per_step: float,
        world_size: int,
        device: torch.device,
        print_fn: Callable[[str], None] | None = None,
        fp16: bool = False,
    ) -> None:
        self.enabled = enabled
        self.fp16 = fp16  # the console shows the loss scale only where there is one
        self.log_interval, self.train_iters = log_interval, train_iters
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.world_size, self.device = world_size, device
        self.print = print_fn or (lambda line: print(line, file=sys.stdout, flush=True))
        self.writer = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir)
        self._paused_at = time.perf_counter()
        self._reset(self._paused_at)
        self._run_start: tuple[float, int] | None = None  # (time, iteration) of the first step

    def _reset(self, now: float) -> None:
        self._start = now
        self._losses: list[float] = []
        self._norms: list[float] = []
        self._skipped = 0

    def pause_clock(self) -> None:
        """Exclude time spent outside training steps (evaluation, checkpoints)."""
        self._paused_at = time.perf_counter()

    def resume_clock(self) -> None:
        self._start += time.perf_counter() - self._paused_at

    def info(self, line: str) -> None:
        if self.enabled:
            self.print(line)

    def write_config(self, config: Mapping[str, object], yaml_text: str) -> None:
        """The resolved config as text (TEXT tab, diffed by tools/compare_runs) and as hparams
        (HPARAMS tab, runs lined up by their settings)."""
        if self.writer is None:
            return
        from megazpp.analysis.hparams import write_hparams

        self.writer.add_text("config", "```yaml\n" + yaml_text + "```", 0)
        write_hparams(self.writer, config)

    def write_scalars(self, values: dict[str, float], step: int) -> None:
        """For other parts (communication counters, ...) to add tags at the same cadence."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def record_step(self, iteration: int, loss: float, lr: float, result: StepResult) -> None:
        if self._run_start is None:
            self._run_start = (self._start, iteration - 1)
        self._losses.append(loss)
        if result.skipped:
            self._skipped += 1
        else:
            self._norms.append(result.grad_norm)
        if iteration % self.log_interval == 0 or iteration in (1, self.train_iters):
            self._emit(iteration, lr, result.loss_scale)

    def _emit(self, iteration: int, lr: float, loss_scale: float) -> None:
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        steps = len(self._losses)
        tokens_per_sec = steps * self.tokens_per_step / elapsed
        tflops = steps * self.flops_per_step / elapsed / self.world_size / 1e12
        values = {
            "train/loss": sum(self._losses) / steps,
            "train/lr": lr,
            "train/grad_norm": sum(self._norms) / len(self._norms) if self._norms else math.nan,
            "train/loss_scale": loss_scale,
            "train/skipped_steps": float(self._skipped),
            "perf/tokens_per_sec": tokens_per_sec,
            "perf/tflops": tflops,
            "mem/peak_bytes": float(peak_memory_bytes(self.device)),
        }
        if self.enabled:
            self.write_scalars(values, iteration)
            if self.writer is not None:
                self.writer.flush()  # a killed rank must not take logged steps with it
            scaling = (
                f"loss_scale {loss_scale:g} | skipped {self._skipped} | "
                if self.fp16
                else f"skipped {self._skipped} | "
                if self._skipped
                else ""
            )
            self.print(
                f"iter {iteration:>6}/{self.train_iters} | loss {values['train/loss']:.4f} | "
                f"lr {lr:.3e} | grad_norm {values['train/grad_norm']:.3f} | {scaling}"
                f"tokens/s {tokens_per_sec:.0f} | tflops {tflops:.4f} | "
                f"peak_mem {values['mem/peak_bytes'] / 2**20:.1f} MiB | {self._clock(iteration, now)}"
            )
        self._reset(now)

    def _clock(self, iteration: int, now: float) -> str:
        """Wall time since this process's first step (evaluation and saves included) and the
        time the remaining steps take at this process's average pace."""
        start, first = self._run_start or (now, iteration)
        elapsed = now - start
        done = iteration - first
        eta = elapsed / done * (self.train_iters - iteration) if done > 0 else math.nan
        return f"elapsed {_hms(elapsed)} | eta {_hms(eta)}"

    def record_eval(self, iteration: int, val_loss: float) -> None:
        if self.enabled:
            self.write_scalars({"val/loss": val_loss}, iteration)
            self.print(f"iter {iteration:>6}/{self.train_iters} | val_loss {val_loss:.4f}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
