"""Train megazpp's model on megazpp's data with DeepSpeed ZeRO: the benchmark's peer.

    python -m torch.distributed.run ... benchmarks/deepspeed_peer.py \
        --ds-zero '{"stage": 3, "zero_hpz_partition_size": 2}' --config CFG [pretrain_gpt flags]

Why it exists: "megazpp ZeRO-3 is at least as fast as DeepSpeed ZeRO-3, with matching losses"
only means something when everything but the data-parallel engine is identical. So this
runner reads the same config and flags as `pretrain_gpt.py`, builds the same `GPTModel` (at
TP = 1 it is plain torch modules, initialised by parameter name, so both start from the same
weights), the same datasets, sampler order, AdamW parameter groups and learning-rate
schedule, and hands only the optimizer step and the gradient/parameter communication to
DeepSpeed. It writes the trainer's TensorBoard tags (`train/loss`, `perf/tokens_per_sec`,
`mem/peak_bytes`), so one reader compares both. DeepSpeed's own collectives bypass
`megazpp.parallel.comm`, so its bytes are measured on the wire only, and the loss averaged
for logging is reduced with torch.distributed directly for the same reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from benchmarks.peer_log import PeerLog
from megazpp.cli import run_tool
from megazpp.config.checks import check_config
from megazpp.config.load import load_config
from megazpp.config.schema import Config
from megazpp.data.builder import build_gpt_datasets
from megazpp.data.options import DataOptions
from megazpp.data.sampler import PretrainingSampler
from megazpp.errors import ConfigError, required
from megazpp.model.gpt import GPTModel
from megazpp.optim.optimizer import build_adamw, named_trainable, param_groups, set_lr
from megazpp.training.lr_schedule import LRSchedule
from megazpp.training.trainer import make_micro_batch
from megazpp.unique_keys import JSONObject

# zero settings both engines read under the same name and meaning: the peer gets megazpp's values
SHARED_ZERO_KEYS = (
    "overlap_comm",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def deepspeed_config(cfg: Config, world_size: int, zero: JSONObject) -> JSONObject:
    """DeepSpeed's JSON for the run `cfg` describes; `zero` overrides `zero_optimization`.

    The client optimizer is torch's AdamW (the one megazpp uses on CPU), which DeepSpeed
    calls "untested" with ZeRO; allowing it keeps the update rule identical on both sides.
    """
    t = cfg.training
    if cfg.precision.bf16 or cfg.precision.fp16:
        raise ConfigError("deepspeed_peer: the peer runs fp32 only (CPU benchmark); drop --bf16 / --fp16")
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.num_micro_batches(world_size),
        "gradient_clipping": cfg.optimizer.clip_grad,
        "steps_per_print": 1 << 30,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": True,
            **{key: getattr(cfg.zero, key) for key in SHARED_ZERO_KEYS},
            **zero,
        },
    }


def parse_args(argv: Sequence[str]) -> tuple[JSONObject, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-zero", default="{}", help="JSON object merged into DeepSpeed's zero_optimization")
    ns, rest = parser.parse_known_args(argv)
    try:
        zero = json.loads(ns.ds_zero)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--ds-zero {ns.ds_zero!r}: not JSON ({exc})") from None
    if not isinstance(zero, dict):
        raise ConfigError(f"--ds-zero {ns.ds_zero!r}: expected a JSON object")
    return zero, rest


def train(cfg: Config, zero: JSONObject, data: DataOptions) -> None:
    import deepspeed  # the optional `bench` extra; imported here so --help works without it

    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    t = cfg.training
    eval_samples = t.eval_iters * required(t.global_batch_size, "training.global_batch_size")
    train_ds, _, _ = build_gpt_datasets(
        data,
        cfg.model.seq_length,
        (t.train_iters * required(t.global_batch_size, "training.global_batch_size"), eval_samples, eval_samples),
        t.seed,
    )
    torch.manual_seed(t.seed)
    model = GPTModel(cfg.model)
    optimizer = build_adamw(param_groups(named_trainable(model), cfg.optimizer.weight_decay), cfg.optimizer)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, world, zero))
    schedule = LRSchedule(
        cfg.optimizer.lr, cfg.optimizer.min_lr, t.lr_warmup_iters, t.lr_decay_iters or t.train_iters, t.lr_decay_style
    )
    samples = iter(PretrainingSampler(len(train_ds), 0, t.micro_batch_size, rank, world, t.seed))
    log = PeerLog(cfg, rank, world)
    for iteration in range(1, t.train_iters + 1):
        start = time.perf_counter()
        set_lr(optimizer, schedule.lr)
        losses = []
        for _ in range(cfg.num_micro_batches(world)):
            inputs, labels = make_micro_batch(train_ds, next(samples), torch.device("cpu"))
            loss = engine(inputs, labels).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        schedule.step()
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        log.step(iteration, float(mean), time.perf_counter() - start)
    log.close()


def main(argv: Sequence[str] | None = None) -> None:
    zero, rest = parse_args(list(sys.argv[1:] if argv is None else argv))
    options = check_config(load_config(rest), int(os.environ.get("WORLD_SIZE", "1")))
    train(options.config, zero, options.data)


if __name__ == "__main__":
    run_tool(main)
