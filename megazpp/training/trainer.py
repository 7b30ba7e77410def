"""The training loop: one optimizer step per iteration, evaluation, checkpoints, logging.

One iteration, top to bottom:
  1. take `num_micro_batches` micro-batches of this data-parallel rank from the sampler;
  2. set the learning rate for the next update and run `forward_backward` (gradients
     accumulate over the micro-batches inside the engine);
  3. `engine.step()`: reduce, unscale, clip, update (or skip an overflowing step);
  4. advance the lr schedule only if the update was applied, count the consumed samples;
  5. check the step's numerics (`numerics.NumericsMonitor`): a non-finite step was skipped
     by the engine; `max_bad_steps` of them in a row stop the run with NumericalError;
  6. in a two-level run with `outer.start_iter` S, after step S (logged and checked): the
     synchronous engine's state moves onto the islands' engine (`start_iter.IslandSwitch`),
     which the rest of the run (this step's evaluation and save included) uses;
  7. log (with the step's communication bytes from `megazpp.parallel.counter`), evaluate,
     save and exit at their intervals, or save and stop early when a rank got SIGTERM /
     SIGINT or `exit_duration_in_mins` has passed (`stopping.py`; the ranks agree each
     step); never save right after a bad step or weights that are not finite.
Everything that decides what happens next (model, engine, schedule, sampler position, RNGs)
is in the checkpoint, so a resumed run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from megazpp import faults
from megazpp.checkpoint.format import LoadedCheckpoint
from megazpp.checkpoint.manager import CheckpointManager, Progress
from megazpp.checkpoint.rng_state import capture_rng_state, restore_rng_state
from megazpp.config.options import RunOptions
from megazpp.data.global_order import GlobalOrder, rank_micro_batches
from megazpp.data.sampler import PretrainingSampler
from megazpp.errors import NumericalError
from megazpp.optim.engine_protocol import Engine, StepResult
from megazpp.parallel import comm
from megazpp.parallel.counter import counter
from megazpp.parallel.topology import Topology
from megazpp.pause import pause_point
from megazpp.training.forward_backward import MicroBatch, forward_backward
from megazpp.training.logger import TrainingLogger
from megazpp.training.lr_schedule import LRSchedule
from megazpp.training.numerics import NumericsMonitor
from megazpp.training.start_iter import IslandSwitch
from megazpp.training.stopping import NO_STOP, SIGNAL, StopRequests

ForwardBackward = Callable[..., list[torch.Tensor]]


class TokenSamples(Protocol):
    """What the trainer draws micro-batches from: samples of token ids by index
    (`GPTDataset`, `BlendedDataset`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


@runtime_checkable
class SamplePositions(Protocol):
    """Where an elastic island's next global batch lies in its job's global sample order
    (`outer.elastic.ElasticDiLoCoEngine`: the positions its islands' data plan gave it)."""

    def next_batch(self, size: int) -> list[int]: ...


@dataclass
class TrainHistory:
    """Per-iteration losses of this run (what tests and tools compare)."""

    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, bool] = field(default_factory=dict)
    loss_spikes: dict[int, float] = field(default_factory=dict)  # iteration -> loss / mean
    resumed_from: int | None = None


def make_micro_batch(dataset: TokenSamples, indices: Sequence[int], device: torch.device) -> MicroBatch:
    """Samples of seq_length + 1 tokens -> (inputs, next-token labels)."""
    rows = torch.from_numpy(np.stack([np.asarray(dataset[i], dtype=np.int64) for i in indices]))
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]


class Trainer:
    def __init__(
        self,
        options: RunOptions,
        model: nn.Module,
        engine: Engine,
        topology: Topology,
        train_ds: TokenSamples,
        valid_ds: TokenSamples | None,
        logger: TrainingLogger,
        device: torch.device,
        *,
        forward_backward_fn: ForwardBackward = forward_backward,
        checkpoints: CheckpointManager | None = None,
        switch: IslandSwitch | None = None,
        positions: SamplePositions | None = None,
    ) -> None:
        """`checkpoints`: the run's loads and saves (pretrain_gpt's, which carries the load plan
        and the frozen base adapters-only saves record); by default one that only saves.
        `options`: the run's checked options, the global batch and warmup resolved. `switch`:
        `engine` is the synchronous phase of a two-level run (`outer.start_iter`), replaced by
        the islands' engine after the step the switch is due at. `positions`: an elastic
        island's, which says where each global batch lies in its job's global sample order
        (instead of the sampler's place, `consumed_samples`)."""
        cfg = options.config
        self.model, self.engine, self.topology = model, engine, topology
        self.training, self.saving = options.training, cfg.checkpoint  # resolved, checked once
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointManager(cfg, topology, device)
        self.train_ds, self.valid_ds = train_ds, valid_ds
        self.logger, self.device = logger, device
        self.forward_backward = forward_backward_fn
        self.switch = switch
        self.positions = positions
        t = options.training
        self.num_micro_batches = options.micro_batches
        self.global_batch_size = options.global_batch_size
        self.lr_schedule = LRSchedule(
            options.optimizer.lr,
            options.optimizer.min_lr,
            t.lr_warmup_iters,
            t.lr_decay_iters or t.train_iters,
            t.lr_decay_style,
        )
        self.iteration = 0
        self.consumed_samples = 0
        self.numerics = NumericsMonitor(
            fp16=options.precision.fp16, spike_factor=t.loss_spike_factor, spike_window=t.loss_spike_window
        )

    # -- checkpoints ------------------------------------------------------------------------
    def resume(self, loaded: LoadedCheckpoint) -> int:
        """Continue the run `loaded` (a verified checkpoint of a run, not weights only) holds;
        return its iteration."""
        progress = self.checkpoints.restore(loaded, self.model, self.engine, self.lr_schedule)
        self.iteration, self.consumed_samples = progress.iteration, progress.consumed_samples
        return self.iteration

    def save(self) -> None:
        """Save through the checkpoint manager (which refuses non-finite weights) and say so."""
        progress = Progress(self.iteration, self.consumed_samples)
        path = self.checkpoints.save(progress, self.model, self.engine, self.lr_schedule)
        self.logger.info(f"iter {self.iteration:>6}/{self.training.train_iters} | saved checkpoint {path}")

    # -- the loop -----------------------------------------------------------------------------
    def _sampler(self, dataset: TokenSamples, consumed: int) -> PretrainingSampler:
        t = self.training
        return PretrainingSampler(
            len(dataset), consumed, t.micro_batch_size, self.topology.dp_rank, self.topology.dp, t.seed
        )

    def _claimed(self, positions: SamplePositions) -> Iterator[list[int]]:
        """This rank's micro-batches of the global batches `positions` names, laid out over the
        island's DP ranks as `PretrainingSampler` lays out a global micro-step."""
        order = GlobalOrder(len(self.train_ds), self.training.seed)
        mbs, dp, rank = self.training.micro_batch_size, self.topology.dp, self.topology.dp_rank
        while True:
            yield from rank_micro_batches(order.samples(positions.next_batch(self.global_batch_size)), mbs, rank, dp)

    def _dp_mean(self, losses: list[torch.Tensor]) -> float:
        """Mean micro-batch loss over all data-parallel ranks (NaN where no loss is computed,
        i.e. on pipeline stages other than the last)."""
        if not losses:
            return math.nan
        mean = torch.stack(losses).mean()
        if self.topology.dp > 1:
            from megazpp.parallel import comm

            comm.all_reduce(mean, group=self.topology.dp_group, tag="train/loss_logging")
            mean = mean / self.topology.dp
        return float(mean)

    def train(self) -> TrainHistory:
        """Run to `train_iters`, or until `exit_interval`, `exit_duration_in_mins`, SIGTERM or
        SIGINT stops the run after a step (saving first when `save` is set)."""
        with StopRequests(self.saving.exit_duration_in_mins) as stop:
            return self._train(stop)

    def _train(self, stop: StopRequests) -> TrainHistory:
        t, ck = self.training, self.saving
        history = TrainHistory(resumed_from=self.iteration or None)
        if self.positions is None:
            samples = iter(self._sampler(self.train_ds, self.consumed_samples))
        else:
            samples = self._claimed(self.positions)
        self.model.train()
        counter.end_step()  # setup traffic (engine init, resume) is not a training step's
        while self.iteration < t.train_iters:
            micro = [make_micro_batch(self.train_ds, next(samples), self.device) for _ in range(self.num_micro_batches)]
            lr = self.lr_schedule.lr
            self.engine.set_lr(lr)
            with faults.poisoned_output(self.model, self.iteration + 1, self.topology.rank):
                losses = self.forward_backward(self.model, micro, self.engine)
            result = self.engine.step()
            if not result.skipped:
                self.lr_schedule.step()
            self.iteration += 1
            self.consumed_samples += self.global_batch_size
            loss = self._dp_mean(losses)
            history.losses[self.iteration] = loss
            history.skipped[self.iteration] = result.skipped
            self.logger.record_step(self.iteration, loss, lr, result)
            self.logger.write_scalars({**counter.end_step(), **result.scalars}, self.iteration)
            if result.scalars:
                self.logger.info(
                    f"iter {self.iteration:>6} | " + " | ".join(f"{k} {v:.4g}" for k, v in result.scalars.items())
                )
            bad = self._check_numerics(loss if losses else None, result, history)
            if self.switch is not None and self.switch.due(self.iteration):
                self._switch_engine(self.switch)  # before the step's evaluation and save: both see the islands

            self.logger.pause_clock()
            faults.maybe_signal(self.iteration, self.topology.rank)
            stop_code = self._agreed_stop(stop)
            evaluating = (
                self.valid_ds is not None
                and t.eval_iters > 0
                and (self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters)
            )
            if evaluating:
                history.val_losses[self.iteration] = self.evaluate()
                self.logger.record_eval(self.iteration, history.val_losses[self.iteration])
            exiting = stop_code != NO_STOP or (ck.exit_interval is not None and self.iteration % ck.exit_interval == 0)
            saving = self.checkpoints.due(self.iteration, exiting)
            if saving and bad:
                self.logger.info(f"iter {self.iteration}: not saving after a non-finite step")
                saving = False
            if saving:
                self.save()
            if evaluating or saving or self.topology.world_size > 1:
                counter.end_step()  # keep evaluation / checkpoint / stop-check traffic out
            self.logger.resume_clock()
            faults.maybe_kill(self.iteration, self.topology.rank)
            if stop_code != NO_STOP:
                self._report_stop(stop_code, stop, saved=saving)
            if exiting:
                break
        return history

    def _switch_engine(self, switch: IslandSwitch) -> None:
        """Collective: the synchronous engine's state onto the islands (`start_iter`); its last
        reference is dropped here, so its memory is freed before the islands' engine is built.
        The switch's traffic is no step's (the loop's next `counter.end_step` drops it)."""
        part = switch.release(self.engine)
        del self.engine
        self.engine, lines = switch.build(part)
        self.switch = None
        for line in lines:
            self.logger.info(line)

    def _agreed_stop(self, stop: StopRequests) -> int:
        """This step's stop decision, the same on every rank: the largest rank's code (one
        4-byte all-reduce per step when there are several ranks)."""
        code = stop.code()
        if self.topology.world_size > 1:
            flag = torch.tensor([float(code)], device=self.device)  # NCCL: on the GPU
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, tag="train/stop_check")
            code = int(flag.item())
        return code

    def _report_stop(self, code: int, stop: StopRequests, saved: bool) -> None:
        why = (
            f"{stop.signal_name or 'a signal on another rank'}"
            if code == SIGNAL
            else f"--exit-duration-in-mins {self.saving.exit_duration_in_mins}"
        )
        if saved:
            where = f"saved checkpoint {self.checkpoints.last}"
        elif self.saving.save:
            where = f"not saved (non-finite step); last good checkpoint: {self.checkpoints.last or 'none'}"
        else:
            where = "nothing saved (no --save)"
        self.logger.info(f"stopped after iteration {self.iteration} ({why}): {where}")

    def _check_numerics(self, loss: float | None, result: StepResult, history: TrainHistory) -> bool:
        """Report spikes and bad steps; stop after `max_bad_steps` bad steps in a row. The
        decision rests on the globally reduced gradient norm (and the loss, which a NaN turns
        into a NaN norm too), so every rank stops at the same step."""
        health = self.numerics.observe(loss, result)
        if health.spike_ratio is not None:
            history.loss_spikes[self.iteration] = health.spike_ratio
            self.logger.write_scalars({"train/loss_spike": health.spike_ratio}, self.iteration)
            self.logger.info(
                f"iter {self.iteration}: loss spike, {loss:.4f} is {health.spike_ratio:.1f}x the recent mean"
            )
        if not health.bad:
            return False
        limit = self.training.max_bad_steps
        message = (
            f"iteration {self.iteration} on rank {self.topology.rank}: loss {loss}, "
            f"grad norm {result.grad_norm} ({health.consecutive_bad} consecutive "
            f"non-finite steps, limit --max-bad-steps {limit}); last good checkpoint: "
            f"{self.checkpoints.last or 'none'}"
        )
        if health.consecutive_bad >= limit:
            raise NumericalError(message)
        self.logger.info(f"skipped update: {message}")
        return True

    def evaluate(self) -> float:
        """Mean loss over the first `eval_iters` batches of the validation split: the same
        samples at every evaluation, so the curve measures the model, not the batch."""
        valid = self.valid_ds
        if valid is None:
            raise ValueError("Trainer.evaluate: this run has no validation split (valid_ds is None)")
        pause_point("evaluation")
        self.model.eval()
        losses: list[torch.Tensor] = []
        samples = iter(self._sampler(valid, 0))
        micro_steps = self.training.eval_iters * self.num_micro_batches
        rng = capture_rng_state()  # evaluation must not shift the training dropout stream
        for _ in range(micro_steps):
            indices = next(samples, None)
            if indices is None:
                break
            batch = make_micro_batch(valid, indices, self.device)
            losses += self.forward_backward(self.model, [batch], self.engine, forward_only=True)
        restore_rng_state(rng)
        self.model.train()
        return self._dp_mean(losses)
