#!/usr/bin/env python3
"""The heterogeneous-network benchmark: every ZeRO / ZeRO++ / PaRO configuration and the
DeepSpeed and torchft peers, trained on 2 nodes x 2 ranks across a rate-limited link (tools/netlab.sh),
at each link setting in turn; one Markdown table and one JSON file per setting, and one figure
of them all (OUT/netlab.png).

    sudo python tools/bench_netlab.py                                   # the full sweep
    sudo python tools/bench_netlab.py --rates 1gbit --only zero3,zeropp,ds-zero3 --steps 5
    sudo python tools/bench_netlab.py --rates loopback --steps 3 -- --hidden-size 64 --num-layers 2
    sudo python tools/bench_netlab.py --rates 1gbit --lora-rank 16 --out runs/bench_netlab_lora
    sudo python tools/bench_netlab.py --rates 100mbit,1gbit --steps 40 --warmup 20 \
        --only zero3,zeropp,diloco-h20-bf16,diloco-h20-int4,diloco-h20-bf16-stream   # two-level rows

Settings: a tc rate (`1gbit`, `10gbit`, ...: netlab up, per-node link shaped) or `loopback`
(no netlab: both node launchers on 127.0.0.1; no link counters). Arguments after `--` go to
every run (pretrain_gpt.py flags, understood by the DeepSpeed peer too). `--lora-rank R` puts
rank-R LoRA adapters on every linear of every run (only they train), runs the configurations
that work with frozen weights (`benchmarks.peft`) and prints the PaRO paper's PEFT verdict
(`--pick`, by default ING, against ZeRO-3). The two-level rows (`diloco-*`: ZeRO-3 inside each
node, DiLoCo across nodes every 20 steps) need --steps and --steps minus --warmup to be multiples
of 20, so their per-step bytes and (mean) step time include the outer syncs; so does the
torchft peer (`torchft-diloco-h20`: torchft's DiLoCo, FSDP2 inside each node, fp32 outer
gradients; needs `--torchft-python`, a python with the `torchft` extra). Needs root for
netlab, and the sample data that `run.sh` builds (data/). netlab is taken down on any exit.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import signal
import sys
import time

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)

from benchmarks import launch, results
from benchmarks.peft import peft_configs, verdict
from benchmarks.plot import plot_settings
from benchmarks.suite import DEEPSPEED, TORCHFT, BenchConfig, all_configs, check_steps, select, steps_fit
from megazpp.cli import add_out_flag, run_tool
from megazpp.config.checks import validate_config
from megazpp.config.load import load_config
from megazpp.errors import DataError, MegazppError, required

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = "configs/experiments/netlab/llama_comm_bound.yaml"
PNG = "netlab.png"  # every setting's tokens/s and inter-node bytes, redrawn after each run


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--rates",
        default="1gbit,10gbit,loopback",
        help="comma-separated link settings, in order (tc rates or 'loopback')",
    )
    p.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--list", action="store_true", help="print the configuration names and exit")
    p.add_argument("--steps", type=int, default=10, help="training steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the median step time")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the benchmark model's YAML")
    p.add_argument("--data-dir", default="data", help="holds corpus_text_document.* and tokenizer.model")
    add_out_flag(p, default="runs/bench_netlab", help="result directory")
    p.add_argument("--delay", default="0", help="netlab link delay (tc syntax; 0: none)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument(
        "--deepspeed-python", default=sys.executable, help="python that can import deepspeed (the `bench` extra)"
    )
    p.add_argument(
        "--torchft-python", default=sys.executable, help="python that can import torchft (the `torchft` extra)"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one configuration may take")
    p.add_argument("--port", type=int, default=29700, help="first rendezvous port (one per run)")
    p.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every linear (0: full training)"
    )
    p.add_argument(
        "--pick", default="paro-ING", help="with --lora-rank: the configuration the verdict compares with zero3"
    )
    p.add_argument(
        "--plot-only",
        action="store_true",
        help="only redraw OUT/netlab.png from the <setting>.json files already in --out",
    )
    ns = p.parse_args(argv)
    ns.extra = extra
    ns.rates = [r for r in ns.rates.split(",") if r]
    ns.only = [n for n in ns.only.split(",") if n] if ns.only else None
    if ns.steps < 1:
        p.error(f"--steps {ns.steps}: expected a positive number of steps")
    if not 0 <= ns.warmup < ns.steps:
        p.error(f"--warmup {ns.warmup}: expected 0 <= warmup < --steps ({ns.steps})")
    if not ns.rates:
        p.error("--rates is empty")
    if ns.lora_rank < 0:
        p.error(f"--lora-rank {ns.lora_rank}: expected 0 (full training) or a positive rank")
    if ns.lora_rank:
        ns.extra = ["--lora-rank", str(ns.lora_rank), *ns.extra]
    return ns


def check_data(data_dir: str) -> tuple[str, str]:
    prefix = os.path.join(data_dir, "corpus_text_document")
    tokenizer = os.path.join(data_dir, "tokenizer.model")
    for path in (prefix + ".idx", prefix + ".bin", tokenizer):
        if not os.path.exists(path):
            raise DataError(
                f"{path} is missing: build the sample data first (`bash run.sh` or "
                f"tools/run_loco_experiment.sh build it under {data_dir}/)"
            )
    return prefix, tokenizer


def shared_run_args(ns: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py's arguments common to every run of `ns` (a configuration's flags go on top);
    tools/bench_netlab_check.py rebuilds a recorded run's jobs from them."""
    prefix, tokenizer = check_data(ns.data_dir)
    return [
        "--config",
        ns.config,
        "--data-path",
        prefix,
        "--tokenizer-model",
        tokenizer,
        "--train-iters",
        str(ns.steps),
        "--ranks-per-node",
        str(ns.ranks_per_node),
        *ns.extra,
    ]


def run_one(
    ns: argparse.Namespace,
    setting: str,
    config: BenchConfig,
    shared_args: list[str],
    layout: launch.Layout,
    tokens_per_step: int,
    port: int,
) -> results.Row:
    run_dir = os.path.abspath(os.path.join(ns.out, setting, config.name))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    python = {DEEPSPEED: ns.deepspeed_python, TORCHFT: ns.torchft_python}.get(config.runner, sys.executable)
    args = [*config.script_args(), *shared_args, "--tensorboard-dir", os.path.join(run_dir, "tb")]
    env = {
        **launch.CPU_RANK_ENV,
        **{k: os.environ[k] for k in launch.CPU_RANK_ENV if k in os.environ},
        "MEGAZPP_COMM_REPORT_DIR": run_dir,
    }
    command = launch.replica_group_command if config.runner == TORCHFT else launch.node_command
    commands = [
        command(setting, n, layout, port, python, run_dir, config.script, args, env) for n in range(layout.nodes)
    ]
    logs = [os.path.join(run_dir, f"node{n}.log") for n in range(layout.nodes)]
    on_netlab = setting != launch.LOOPBACK
    before = launch.netlab_rx_bytes(layout.nodes) if on_netlab else None
    start = time.perf_counter()
    failure = launch.run_nodes(commands, logs, ns.timeout)
    wall = time.perf_counter() - start
    wire = launch.netlab_rx_bytes(layout.nodes) - before if before is not None else None  # on netlab
    collect = functools.partial(
        results.collect_row,
        config.name,
        config.runner,
        run_dir,
        steps=ns.steps,
        tokens_per_step=tokens_per_step,
        world_size=layout.world_size,
        wire_bytes=wire,
        wall_s=wall,
        warmup=ns.warmup,
        amortised=config.sync_every is not None,
    )
    try:
        return collect(failure=failure)
    except MegazppError as exc:
        return collect(failure=f"unreadable results: {exc}")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    os.chdir(REPO)
    if ns.plot_only:
        print(plot_settings(ns.out, os.path.join(ns.out, PNG)))
        return 0
    layout = launch.Layout(ns.nodes, ns.ranks_per_node)
    offered = all_configs(layout.ranks_per_node)
    configs = select(peft_configs(offered) if ns.lora_rank else offered, ns.only)
    if ns.list:
        print("\n".join(c.name for c in configs))
        return 0
    if ns.only is None:  # the default sweep: two-level rows only where the run measures whole intervals
        left = [c.name for c in configs if not steps_fit(c, ns.steps, ns.warmup)]
        configs = [c for c in configs if c.name not in left]
        if left:
            print(
                f"leaving out {', '.join(left)}: --steps {ns.steps} --warmup {ns.warmup} do not measure whole "
                f"outer intervals (name them with --only to be told what fits)",
                flush=True,
            )
    check_steps(configs, ns.steps, ns.warmup)
    shared = shared_run_args(ns)
    # refuse a bad YAML, flag or row here, not in 4 x N ranks (`select` leaves at least one row)
    cfg = [
        validate_config(load_config([*shared, *c.flags]), layout.world_size, layout.ranks_per_node) for c in configs
    ][0]
    tokens_per_step = required(cfg.training.global_batch_size, "training.global_batch_size") * cfg.model.seq_length
    command = shlex.join(["python", "tools/bench_netlab.py", *(sys.argv[1:] if argv is None else argv)])
    # a SIGTERM (a job's time limit) unwinds through the netlab teardown below; the caller's own
    # handler comes back after (main runs in-process in tests: a handler left behind would reach
    # every process the caller forks later)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        port = ns.port
        for setting in ns.rates:
            rows: list[results.Row] = []
            try:
                if setting != launch.LOOPBACK:
                    launch.netlab_up(layout.nodes, setting, ns.delay)
                for config in configs:
                    print(f"[{setting}] {config.name} ...", flush=True)
                    rows.append(run_one(ns, setting, config, shared, layout, tokens_per_step, port))
                    port += launch.replica_group_ports(layout.nodes) if config.runner == TORCHFT else 1
                    md, _ = results.write_setting(ns.out, setting, rows, command)
                    plot_settings(ns.out, os.path.join(ns.out, PNG))
                    print(
                        f"[{setting}] {config.name}: {rows[-1].status}, "
                        f"{results.fmt(rows[-1].tokens_per_s, digits=0)} tokens/s -> {md}",
                        flush=True,
                    )
            finally:
                if setting != launch.LOOPBACK:
                    launch.netlab_down()
            if ns.lora_rank:
                print(f"[{setting}] {verdict(rows, ns.pick)}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    run_tool(main)
