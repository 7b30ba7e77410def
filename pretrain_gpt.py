#!/usr/bin/env python3
"""Pretrain a GPT-2 or Llama model: `pretrain_gpt.py --config FILE [Megatron-style flags]`.

Launched directly (one process) or by torchrun (`run.sh`), which sets RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK. The whole configuration is checked against the
world size before the process group starts (`megazpp.training.startup`, which also asks the
checkpoint manager what the run loads), so a bad flag never leaves ranks waiting. This file
builds the parts and runs them; loads and saves are `megazpp/checkpoint/manager.py`'s.
`--help` lists every flag.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megazpp.checkpoint.manager import CheckpointManager
from megazpp.cli import configure_logging, run_tool
from megazpp.config.options import RunOptions
from megazpp.config.reference import render_help
from megazpp.config.schema import Config
from megazpp.data.builder import build_gpt_datasets
from megazpp.launch.lifeline import die_with_launcher
from megazpp.launch.local_ranks import release_process_groups
from megazpp.launch.preflight import check_nodes
from megazpp.model.compile import compile_layers
from megazpp.model.flops import training_flops_per_token
from megazpp.model.gpt import GPTModel
from megazpp.model.trainable import apply_trainable
from megazpp.optim.engine_protocol import Engine
from megazpp.optim.local_engine import LocalEngine
from megazpp.parallel.device import rank_device, visible_gpus
from megazpp.parallel.pipeline import counts_in_norm, forward_backward_1f1b
from megazpp.parallel.tensor_parallel import model_parallel_seed
from megazpp.parallel.topology import Topology
from megazpp.training.banner import banner
from megazpp.training.forward_backward import forward_backward
from megazpp.training.logger import TrainingLogger
from megazpp.training.start_iter import build_islands, check_start, island_switch, planned_iteration
from megazpp.training.startup import Startup, prepare, read_handoff, replan, torchrun_restart_count
from megazpp.training.trainer import ForwardBackward, SamplePositions, Trainer, TrainHistory
from megazpp.training.zero_factory import build_zero_engine


def pick_device() -> torch.device:
    """GPU LOCAL_RANK mod (GPUs), shared round robin when ranks outnumber GPUs (gloo only:
    `startup.prepare` refused NCCL there), or the CPU."""
    device = rank_device(int(os.environ.get("LOCAL_RANK", "0")), visible_gpus())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed(cfg: Config, world_size: int, backend: str) -> bool:
    """Start the process group torchrun describes on `backend`; False when there is nothing to
    start (one rank, or a caller such as a test launcher already started it and will end it)."""
    if world_size <= 1 or dist.is_initialized():
        return False
    dist.init_process_group(backend, timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    return True


def seed_everything(seed: int, topology: Topology) -> None:
    """Data order comes from the sampler's own seed; these drive dropout and any host-side
    randomness, identical across data-parallel replicas, per stage/TP rank as the TP RNG
    streams require."""
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed, topology.tp_rank, topology.pp_rank)


def build_engine(model: GPTModel, topology: Topology, options: RunOptions, iteration: int = 0) -> Engine:
    """LocalEngine for one model replica (any TP x PP); the ZeRO engine when data parallel or
    when a ZeRO stage / PaRO strategy is asked for (stage 0 over DP > 1 is NNN: plain DDP);
    with two-level training (`options.outer`), the ZeRO engine over each island's DP ranks
    inside the DiLoCo engine, or, for a run starting at `iteration` before `outer.start_iter`,
    the ZeRO engine over all DP ranks until the trainer's switch (`training/start_iter.py`).
    `options` were checked before any rank started (`startup.prepare`)."""
    outer = options.outer
    if outer is not None and iteration >= outer.start_iter:
        return build_islands(model, options, topology)
    if options.uses_zero_engine:
        return build_zero_engine(model, options, topology, counts_in_norm=counts_in_norm(model, topology))
    group = topology.model_parallel_group
    model_parallel = [group] if options.config.tp * options.config.pp > 1 and group is not None else []
    return LocalEngine(
        model,
        options.optimizer,
        options.precision,
        norm_groups=model_parallel,
        counts_in_norm=counts_in_norm(model, topology),
    )


def pick_schedule(cfg: Config, topology: Topology) -> ForwardBackward:
    if cfg.pp == 1:
        return forward_backward
    return functools.partial(forward_backward_1f1b, topology=topology, sequence_parallel=cfg.parallel.sequence_parallel)


def build_model(cfg: Config, topology: Topology, device: torch.device) -> GPTModel:
    model = GPTModel(
        cfg.model,
        tp_group=topology.tp_group,
        sequence_parallel=cfg.parallel.sequence_parallel,
        pre_process=topology.is_first_stage,
        post_process=topology.is_last_stage,
        layer_range=topology.layer_range(cfg.model.num_layers),
    )
    apply_trainable(model, cfg.training.trainable, cfg.model)
    model = model.to(device)
    if cfg.training.compile:
        compile_layers(model.layers)
    return model


def main(argv: Sequence[str] | None = None) -> TrainHistory | int:
    die_with_launcher()  # a rank of run.sh's launcher ends with it, however it ends
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(render_help([a for a in args if a not in ("--help", "-h")]), end="")
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # under a launcher, its once-per-job check (run.sh: startup.main) compared the memory
    # estimate with the node's; ranks starting side by side would each see another share
    alone = "LOCAL_WORLD_SIZE" not in os.environ
    handed = read_handoff(args, world_size)  # run.sh's check decided for its ranks: nothing is checked again
    if handed is not None:
        start = replan(
            handed, world_size, torchrun_restart_count(), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        )
    else:
        start = prepare(args, world_size, torchrun_restart_count(), ranks_on_node=1 if alone else None)
    device = pick_device()
    started = init_distributed(start.cfg, world_size, start.backend)
    finished = False
    try:
        history = _train(start, device)
        finished = True
        return history
    finally:
        if started:  # before the interpreter shuts down: see release_process_groups
            release_process_groups(finished=finished)


def _train(start: Startup, device: torch.device) -> TrainHistory:
    cfg = start.cfg
    topology = Topology.from_env(cfg.tp, cfg.pp, cfg.parallel.ranks_per_node)
    configure_logging(topology.rank, to_stdout=True)
    check_nodes(topology, cfg.data.data_path, cfg.data.tokenizer_model, cfg.checkpoint.save)
    checkpoints = CheckpointManager(cfg, topology, device, start.load)
    checkpoints.check_writable()
    with checkpoints.hold_save_dir():
        return _train_holding_save(start, device, topology, checkpoints)


def _train_holding_save(
    start: Startup, device: torch.device, topology: Topology, checkpoints: CheckpointManager
) -> TrainHistory:
    cfg = start.cfg
    seed_everything(cfg.training.seed, topology)
    t, global_batch = cfg.training, start.options.global_batch_size
    eval_samples = t.eval_iters * global_batch
    train_ds, valid_ds, _ = build_gpt_datasets(
        start.options.data,
        cfg.model.seq_length,
        (start.options.train_samples, eval_samples, eval_samples),
        t.seed,
        vocab_size=cfg.model.vocab_size,
    )
    model = build_model(cfg, topology, device)
    checkpoints.load_base(model)  # before the engine: it copies the weights into its masters
    engine = build_engine(model, topology, start.options, planned_iteration(start.load))
    loaded = checkpoints.load(model, engine)
    check_start(start.options, engine, loaded)
    tokens_per_step = global_batch * cfg.model.seq_length
    logger = TrainingLogger(
        enabled=topology.is_last_stage and topology.tp_rank == 0 and topology.dp_rank == 0,
        tensorboard_dir=cfg.logging.tensorboard_dir,
        log_interval=cfg.logging.log_interval,
        train_iters=t.train_iters,
        tokens_per_step=tokens_per_step,
        flops_per_step=float(training_flops_per_token(cfg.model)) * tokens_per_step,
        world_size=topology.world_size,
        device=device,
        fp16=cfg.precision.fp16,
    )
    logger.write_config(cfg.to_dict(), cfg.to_yaml())
    for line in banner(cfg, topology, engine, (train_ds, valid_ds), start):
        logger.info(line)
    trainer = Trainer(
        start.options,
        model,
        engine,
        topology,
        train_ds,
        valid_ds,
        logger,
        device,
        forward_backward_fn=pick_schedule(cfg, topology),
        checkpoints=checkpoints,
        switch=island_switch(model, start.options, topology, engine),
        positions=engine if isinstance(engine, SamplePositions) else None,
    )
    del engine  # the trainer's from here: replaced at outer.start_iter, the synchronous one then freed
    if loaded is not None and not loaded.weights_only:
        trainer.resume(loaded)
    started = checkpoints.start_line(loaded, trainer.iteration)
    if started is not None:
        logger.info(started)
    try:
        history = trainer.train()
        trainer.engine.close()  # collective: what is in flight is finished, the model unhooked
        return history
    finally:
        logger.close()  # joins TensorBoard's writer thread


if __name__ == "__main__":
    run_tool(main)
