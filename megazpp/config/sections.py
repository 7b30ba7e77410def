"""The sections the run's own loop reads: `training`, `checkpoint` and `logging`, each a frozen
type checked when built, with each field's help beside it.

Why in the config layer: their readers (the trainer, the checkpoint manager, the logger) sit
above it (`training/`, `checkpoint/`), and a section below its reader is what lets the loader
build and check it before any of them exists; the planner's section lives in this layer for the
same reason (`planner.py`). Every subsystem below the config owns its section itself
(`zero.options.ZeroOptions`, `parallel.options.ParallelOptions`, ...). Each constructor checks
the rules of its own values, naming the key; the rules that need the world size or another
section (the global batch against dp, adapters-only saves against what trains) are
`config.checks`', once, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megazpp.errors import ConfigError
from megazpp.setting import require_positive, setting


@dataclass(frozen=True)
class TrainingOptions:
    """Batching, length of the run, learning-rate shape, evaluation cadence and seeding.

    `global_batch_size` None means one micro-batch per data-parallel rank per step, or
    micro x `gradient_accumulation_steps` x dp when the latter is given (DeepSpeed style).
    `seed` drives data order and dropout; parameter init uses `model.init_seed`.
    """

    micro_batch_size: int = setting(4, "samples per rank per forward/backward")
    global_batch_size: int | None = setting(None, "samples per optimizer step; none: micro x dp")
    gradient_accumulation_steps: int | None = setting(
        None, "micro-batches per step (DeepSpeed style; sets the global batch)"
    )
    train_iters: int = setting(100, "optimizer steps of the run")
    lr_warmup_iters: int = setting(0, "linear warmup steps (a config file's warmup is scaled to a shorter run)")
    lr_warmup_fraction: float | None = setting(
        None, "warmup as a fraction of the decay length (instead of lr_warmup_iters)"
    )  # Megatron's: warmup as a fraction of the decay
    lr_decay_iters: int | None = setting(
        None, "decay length; none: train_iters"
    )  # None: decay over the whole run (train_iters)
    lr_decay_style: Literal["cosine", "linear", "constant"] = setting("cosine", "cosine, linear or constant")
    eval_interval: int = setting(100, "evaluate every N steps (and at the last)")
    eval_iters: int = setting(10, "validation batches per evaluation (0: none)")
    seed: int = setting(1234, "data order and dropout")
    # Numerical faults (bf16 / fp32; fp16 overflow is the loss scaler's business): a step
    # with a non-finite loss or gradient norm is skipped; this many in a row stop the run.
    max_bad_steps: int = setting(5, "stop after N consecutive non-finite steps")
    # A loss above factor x the mean of the last `loss_spike_window` good losses is logged as
    # a spike (TensorBoard `train/loss_spike`); 0 turns spike detection off.
    loss_spike_factor: float = setting(3.0, "log a spike above this x the recent mean loss (0: off)")
    loss_spike_window: int = setting(50, "good steps in the recent mean")
    # What trains (megazpp.model.trainable): name globs or last:N; empty: everything, or only
    # the adapters when model.lora_rank > 0 (patterns then add to the adapters)
    trainable: list[str] = setting(
        [], "what trains: name globs (*norm* *.bias layers.7.*) or last:N layers; empty: all (LoRA: adapters)"
    )
    # torch.compile each transformer layer (megazpp.model.compile); the first steps pay for it
    compile: bool = setting(
        False,
        "torch.compile each transformer layer (rotary in real arithmetic); the first steps compile; needs whole "
        "parameters (zero.stage <= 2 or PaRO N**)",
    )
    # Start even when the planner's memory estimate per rank exceeds the free memory
    # (megazpp.training.memory_check); a launch guard, not a setting of the run's state.
    skip_memory_check: bool = setting(False, "start even when the estimated memory per rank exceeds the free memory")

    def __post_init__(self) -> None:
        for key in (
            "micro_batch_size",
            "global_batch_size",
            "gradient_accumulation_steps",
            "train_iters",
            "eval_interval",
            "lr_decay_iters",
            "max_bad_steps",
            "loss_spike_window",
        ):
            require_positive(f"training.{key}", getattr(self, key))
        if self.loss_spike_factor != 0 and self.loss_spike_factor <= 1:
            raise ConfigError(
                f"training.loss_spike_factor = {self.loss_spike_factor}: expected 0 (off) or a factor > 1"
            )
        if self.eval_iters < 0 or self.lr_warmup_iters < 0:
            raise ConfigError(
                f"training.eval_iters and training.lr_warmup_iters must be >= 0, got {self.eval_iters} and "
                f"{self.lr_warmup_iters}"
            )
        fraction = self.lr_warmup_fraction
        if fraction is not None:
            if not 0 <= fraction <= 1:
                raise ConfigError(f"training.lr_warmup_fraction = {fraction}: expected a fraction in [0, 1]")
            if self.lr_warmup_iters:
                raise ConfigError(
                    f"training.lr_warmup_fraction = {fraction} and "
                    f"training.lr_warmup_iters = {self.lr_warmup_iters} are both set: give one"
                )
        if self.warmup_iters > self.decay_iters:
            raise ConfigError(
                f"training.lr_warmup_iters = {self.warmup_iters} exceeds the decay "
                f"length (lr_decay_iters or train_iters) = {self.decay_iters}"
            )

    @property
    def decay_iters(self) -> int:
        """The learning rate's decay length: `lr_decay_iters`, else the whole run."""
        return self.lr_decay_iters or self.train_iters

    @property
    def warmup_iters(self) -> int:
        """The warmup in iterations, which is what the schedule and checkpoints record (a
        fraction of the decay length resolved)."""
        if self.lr_warmup_fraction is None:
            return self.lr_warmup_iters
        return round(self.lr_warmup_fraction * self.decay_iters)


@dataclass(frozen=True)
class CheckpointOptions:
    """Megatron's checkpoint flags: `exit_interval` N stops after step N (saving if `save`).

    With `save` and no `load`, a run resumes from `save`'s latest checkpoint if it has one,
    so a job restarted by its launcher continues where it stopped.
    """

    save: str | None = setting(None, "save directory (also resumed from: see the README's resume rule)")
    load: str | None = setting(None, "continue the run whose checkpoint is here, whatever its settings")
    save_interval: int | None = setting(None, "save every N steps (and at the last)")
    # A run that saves often (an elastic island at every outer sync) fills its disk with
    # checkpoints nobody will load; torchtitan's keep_latest_k does the same job.
    keep_last: int | None = setting(
        None, "keep the newest N checkpoints in save: older ones are removed once a newer one is complete (none: all)"
    )
    exit_interval: int | None = setting(None, "stop after step N, saving first")
    # Stop (saving if `save`) after the first step that ends this many minutes after the
    # program started, as Megatron's --exit-duration-in-mins; SIGTERM / SIGINT stop the same way.
    exit_duration_in_mins: float | None = setting(
        None, "stop (saving first) after the step that ends this many minutes after start"
    )
    # Load the next older complete checkpoint when the newest is refused (never by default:
    # silently losing progress is worse than stopping to look).
    load_fallback: bool = setting(False, "load the previous complete checkpoint if the newest is refused")
    # `load` naming no checkpoint is an error (a mistyped path would start from scratch and
    # overwrite `save`'s checkpoints) unless this is set.
    load_optional: bool = setting(False, "a --load holding no checkpoint starts from scratch instead of being refused")
    # Allow a run that starts below the newest checkpoint in `save` to move `latest` back.
    overwrite_newer_checkpoints: bool = setting(
        False, "allow a run starting below --save's newest checkpoint to move latest back"
    )
    # Save only the trainable parameters (LoRA adapters, `training.trainable`) and their state;
    # the frozen base is reloaded from the import or init the run started from (frozen_base.py).
    save_adapters_only: bool = setting(
        False,
        "save only what trains (LoRA adapters, training.trainable) and its state; resuming reloads the recorded "
        "frozen base",
    )

    def __post_init__(self) -> None:
        for key in ("save_interval", "keep_last", "exit_interval", "exit_duration_in_mins"):
            require_positive(f"checkpoint.{key}", getattr(self, key))
        if self.keep_last == 1 and self.load_fallback:
            raise ConfigError(
                "checkpoint.keep_last = 1 with checkpoint.load_fallback: the fallback loads the previous "
                "checkpoint, which keep_last 1 removes; keep at least 2 (--keep-last 2) or drop --load-fallback"
            )


@dataclass(frozen=True)
class LoggingOptions:
    """Where and how often the run reports: the console line and TensorBoard."""

    tensorboard_dir: str | None = setting(None, "TensorBoard event directory (none: console only)")
    log_interval: int = setting(10, "console line and TensorBoard points every N steps")

    def __post_init__(self) -> None:
        require_positive("logging.log_interval", self.log_interval)
