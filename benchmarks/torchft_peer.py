"""Train megazpp's model on megazpp's data with torchft's DiLoCo: the two-level rows' peer.

    # one launcher per replica group (node); group 0's first rank also runs the lighthouse
    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 ... benchmarks/torchft_peer.py \
        --replica-group 0 --replica-groups 2 --lighthouse 10.78.0.1:29700 --advertise 10.78.0.1 \
        --config CFG --outer-algorithm diloco --outer-sync-every 20 [pretrain_gpt flags]

Why it exists: issue 28's two-level rows (ZeRO-3 inside a node, DiLoCo across nodes) mean
more beside the low-communication trainer users know. torchft (`pip install -e .[torchft]`)
runs DiLoCo over *replica groups*: each group is its own torch.distributed job (here one per
node, FSDP2 = ZeRO-3 over the node's ranks), and a torchft `Manager` per rank joins rank r of
every group through torchft's own gloo process group, formed at each outer step from a quorum
that the lighthouse (torchft's coordination server, in the wheel) hands out.

Same as the megazpp rows: the config and flags (the `outer` section's H, outer lr and
momentum), the `GPTModel` (plain torch modules at TP = 1, initialised by parameter name), the
datasets and sampler order (rank g x R + r of the whole world reads what megazpp's global rank
does, so a group reads its slice of every global batch), AdamW parameter groups, lr schedule
and gradient clipping; the outer step is torch's Nesterov SGD on the groups' averaged
pseudo-gradients, as DiLoCo's. Different, by torchft's design: its outer all-reduce moves fp32
(its quantized all-reduce is a Triton kernel; on CPU `should_quantize` silently falls back to
fp32, torchft/manager.py:458), so only `outer.quantize none` is accepted, and torchft's
collectives bypass `megazpp.parallel.comm`, so its bytes are measured on the wire only. The
logged loss is the mean over all ranks, as megazpp logs it, through a gloo group of its own
(`loss_group`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.peer_log import PeerLog
from megazpp.cli import run_tool
from megazpp.config.checks import check_config
from megazpp.config.load import load_config
from megazpp.config.options import RunOptions
from megazpp.config.schema import Config
from megazpp.data.builder import build_gpt_datasets
from megazpp.data.options import DataOptions
from megazpp.data.sampler import PretrainingSampler
from megazpp.errors import ConfigError, required
from megazpp.model.gpt import GPTModel
from megazpp.optim.optimizer import build_adamw, named_trainable, param_groups, set_lr
from megazpp.outer.settings import OuterOptions
from megazpp.training.lr_schedule import LRSchedule
from megazpp.training.trainer import make_micro_batch

# torchft's waits (quorum, collectives, should_commit): an outer step at 100 Mbit/s moves the
# whole fp32 model, so they are generous; the benchmark's own --timeout still bounds a row.
TIMEOUT = timedelta(minutes=15)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica-group", type=int, required=True, help="this launcher's group (its node)")
    parser.add_argument("--replica-groups", type=int, required=True, help="groups in all (nodes)")
    parser.add_argument(
        "--lighthouse", required=True, help="HOST:PORT of the lighthouse, which group 0's first rank starts"
    )
    parser.add_argument(
        "--loss-store",
        required=True,
        help="HOST:PORT of the store (hosted by group 0's first rank) of the process group "
        "over all ranks that averages the logged loss",
    )
    parser.add_argument(
        "--advertise",
        required=True,
        help="this node's address as the other groups reach it (its rendezvous store, "
        "where torchft forms the outer process group)",
    )
    ns, rest = parser.parse_known_args(argv)
    if ns.replica_groups < 2:
        raise ConfigError(f"--replica-groups {ns.replica_groups}: DiLoCo needs at least 2 replica groups")
    if not 0 <= ns.replica_group < ns.replica_groups:
        raise ConfigError(f"--replica-group {ns.replica_group}: expected 0..{ns.replica_groups - 1}")
    for flag, value in (("--lighthouse", ns.lighthouse), ("--loss-store", ns.loss_store)):
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{flag} {value!r}: expected HOST:PORT")
    return ns, rest


def peer_outer(cfg: Config, run: RunOptions) -> OuterOptions:
    """The outer options the peer runs (`run`'s, built once by `check_config`), or ConfigError
    for what it cannot run the same way."""
    if cfg.precision.bf16 or cfg.precision.fp16:
        raise ConfigError("torchft_peer: the peer runs fp32 only (CPU benchmark); drop --bf16 / --fp16")
    if cfg.tp > 1 or cfg.pp > 1 or cfg.model.lora_rank:
        raise ConfigError(
            "torchft_peer: tensor/pipeline parallelism and LoRA are not part of torchft's DiLoCo "
            "over FSDP replica groups; run it with TP = PP = 1 and full training"
        )
    options = run.outer
    if options is None:
        raise ConfigError(
            "torchft_peer: outer.algorithm is none; the peer runs DiLoCo "
            "(--outer-algorithm diloco --outer-sync-every H)"
        )
    if options.quantize != "none":
        raise ConfigError(
            f"outer.quantize = {options.quantize!r}: torchft's outer all-reduce on CPU moves fp32 "
            f"(its quantized path is a Triton kernel, torchft/manager.py:458); use none"
        )
    if options.fragments != 1 or options.overlap_steps or options.island_nodes != 1:
        raise ConfigError(
            "torchft_peer: outer.fragments, outer.overlap_steps and outer.island_nodes are not "
            "mapped onto torchft's replica groups; the peer runs plain DiLoCo, one group per node"
        )
    if options.optimizer_state_every:
        raise ConfigError(
            f"outer.optimizer_state_every = {options.optimizer_state_every}: torchft's DiLoCo keeps each "
            f"replica group's inner optimizer state; set --outer-optimizer-state-every 0"
        )
    return options


def shard(model: GPTModel) -> None:
    """FSDP2 (ZeRO-3: parameters, gradients and AdamW state sharded over the group's ranks,
    gathered per layer) over the default process group, i.e. this replica group."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)


def loss_group(address: str, rank: int, world: int) -> dist.ProcessGroupGloo:
    """A gloo group over every rank of every replica group, for the logged loss only: the mean
    over all ranks that megazpp's trainer logs (one scalar all-reduce per step, as its own),
    which torchft, having no process group over all ranks, does not give."""
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(dist.PrefixStore("loss", store), rank, world, TIMEOUT)


def train(cfg: Config, ns: argparse.Namespace, options: OuterOptions, data: DataOptions) -> None:
    # imported here so --help and the checks work in a python without torchft (--torchft-python)
    try:
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as exc:
        raise ConfigError(
            f"torchft_peer: {sys.executable} cannot import torchft ({exc}): install the project "
            f"(pip install -e ., torchft is a core dependency) or give bench_netlab.py --torchft-python"
        ) from None

    dist.init_process_group("gloo")
    local_rank, per_group = dist.get_rank(), dist.get_world_size()
    rank, world = ns.replica_group * per_group + local_rank, ns.replica_groups * per_group
    host, _, port = ns.lighthouse.rpartition(":")
    lighthouse = None
    if rank == 0:
        lighthouse = LighthouseServer(bind=f"[::]:{port}", min_replicas=ns.replica_groups)
    losses_pg = loss_group(ns.loss_store, rank, world)
    t = cfg.training
    global_batch = required(t.global_batch_size, "training.global_batch_size")
    eval_samples = t.eval_iters * global_batch
    train_ds, _, _ = build_gpt_datasets(
        data,
        cfg.model.seq_length,
        (t.train_iters * global_batch, eval_samples, eval_samples),
        t.seed,
    )
    torch.manual_seed(t.seed)
    model = GPTModel(cfg.model)
    shard(model)
    inner = build_adamw(param_groups(named_trainable(model), cfg.optimizer.weight_decay), cfg.optimizer)
    outer = torch.optim.SGD(model.parameters(), lr=options.lr, momentum=options.momentum, nesterov=True)
    # every group starts from the same seeded weights, so no start-up sync (init_sync=False);
    # min_replica_size = all groups: every outer step averages all of them, as megazpp's does
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ns.replica_groups,
        use_async_quorum=False,
        replica_id=f"group{ns.replica_group}",
        lighthouse_addr=f"http://{host}:{port}",
        store_addr=ns.advertise,
        hostname=ns.advertise,
        store_port=int(os.environ["MASTER_PORT"]),
        rank=local_rank,
        world_size=per_group,
        init_sync=False,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
    )
    schedule = LRSchedule(
        cfg.optimizer.lr, cfg.optimizer.min_lr, t.lr_warmup_iters, t.lr_decay_iters or t.train_iters, t.lr_decay_style
    )
    samples = iter(PretrainingSampler(len(train_ds), 0, t.micro_batch_size, rank, world, t.seed))
    log = PeerLog(cfg, rank, world)
    micro_batches = cfg.num_micro_batches(world)
    with DiLoCo(
        manager,
        [model],
        inner,
        outer,
        sync_every=options.sync_every,
        backup_device=torch.device("cpu"),
        pin_memory=False,
    ):
        for iteration in range(1, t.train_iters + 1):
            start = time.perf_counter()
            set_lr(inner, schedule.lr)
            losses = []
            for _ in range(micro_batches):
                inputs, labels = make_micro_batch(train_ds, next(samples), torch.device("cpu"))
                loss = model(inputs, labels).mean()
                (loss / micro_batches).backward()
                losses.append(loss.detach())
            if cfg.optimizer.clip_grad > 0:  # 0 disables clipping, as in megazpp's engine
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
            inner.step()  # every H-th step torchft's hook runs the outer step inside it
            inner.zero_grad(set_to_none=True)
            schedule.step()
            mean = torch.stack(losses).mean()
            losses_pg.allreduce([mean]).wait()  # type: ignore[attr-defined]  # the binding's method; torch's stubs lack it
            log.step(iteration, float(mean), time.perf_counter() - start, f"outer steps {manager.current_step()}")
    log.close()
    expected = t.train_iters // options.sync_every
    if manager.current_step() != expected:
        raise RuntimeError(
            f"torchft committed {manager.current_step()} outer steps of {expected}: a quorum or "
            f"all-reduce failed and torchft discarded the step (see the log above)"
        )
    manager.shutdown(wait=False)
    losses_pg.barrier().wait()  # type: ignore[attr-defined]  # as allreduce above; no group's store (the loss group's, its launcher's) goes while another uses it
    dist.destroy_process_group()
    if lighthouse is not None:  # every group is past its last quorum once group 0 has its last outer step
        lighthouse.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    ns, rest = parse_args(list(sys.argv[1:] if argv is None else argv))
    given = load_config(rest)
    per_group = int(os.environ.get("WORLD_SIZE", "1"))
    world = ns.replica_groups * per_group
    run = check_config(given, world, per_group)  # every subsystem's options; the peer's own rules next
    train(run.config, ns, peer_outer(run.config, run), run.data)


if __name__ == "__main__":
    run_tool(main)
