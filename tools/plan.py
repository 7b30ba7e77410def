"""Predict memory and step time of every PaRO strategy / ZeRO++ combination before launch.

The model comes from a megazpp config (`--config`, with batch, precision and parallel sizes
from the same file unless overridden) or from its dimensions (`--arch --num-layers
--hidden-size --num-attention-heads ...`, the training job's flags; `--params` picks the FFN width that gives that
parameter count). The cluster is
described by flags, with `--accelerator` filling in typical memory, compute and NVLink values.
Memory and byte terms are `megazpp.zero.memory` and `traffic` (what the engine's tests assert); the
planner adds activations, timing and the fit test (docs/planning.md). With 2 nodes or more, the
two-level options follow (synchronous ZeRO inside islands, DiLoCo across them: a different
optimisation, marked so), with a recommended H, fragment count, overlap and outer quantization.

    python tools/plan.py --accelerator h100-80gb --nodes 8 --gpus-per-node 8 --inter-gbit 400 \\
        --arch llama --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \\
        --vocab-size 32000 --seq-length 4096 --micro-batch-size 1 --global-batch-size 1024 --dtype bf16 \\
        --activation-checkpointing
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from megazpp.cli import run_tool
from megazpp.config.load import load_config
from megazpp.config.schema import Config
from megazpp.config.tool_flags import add_shape_flags, model_config
from megazpp.errors import ConfigError, MegazppError
from megazpp.model.config import ModelConfig
from megazpp.model.flops import parameter_count
from megazpp.planner.cluster import ACCELERATORS, GIB, Cluster, gbit
from megazpp.planner.plan import plan
from megazpp.planner.report import summary, table, two_level_reason, two_level_table
from megazpp.planner.shape import shapes_of_config
from megazpp.planner.two_level import plan_two_level
from megazpp.planner.workload import DTYPE_BYTES, Workload, workload_of_config
from megazpp.zero.zeropp import ZeroPP


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model (or --config)")
    m.add_argument("--config", help="megazpp YAML config (model, training, precision, parallel, zero)")
    add_shape_flags(
        m,
        {
            "arch": "llama",
            "num_layers": None,
            "hidden_size": None,
            "num_attention_heads": None,
            "num_query_groups": None,
            "ffn_hidden_size": None,
            "vocab_size": None,
            "seq_length": None,
        },
    )
    m.add_argument("--params", type=float, help="total parameters (e.g. 7e9): sets the FFN width")
    j = p.add_argument_group("job (override --config)")
    add_shape_flags(j, {"micro_batch_size": None, "global_batch_size": None})
    j.add_argument("--tp", type=int)
    j.add_argument("--pp", type=int)
    j.add_argument("--sequence-parallel", action="store_true", default=None)
    j.add_argument("--dtype", choices=sorted(DTYPE_BYTES))
    j.add_argument("--grad-accum", choices=sorted(DTYPE_BYTES))
    j.add_argument("--activation-checkpointing", action="store_true", default=None)
    j.add_argument(
        "--no-flash-attention",
        action="store_true",
        help="count the attention score matrix in activations (no fused attention kernel)",
    )
    j.add_argument(
        "--trainable-fraction",
        type=float,
        help="PEFT: fraction of the weights that is trained; the frozen rest is held at level p "
        "and gathered like trainable weights, never reduced (default: from --config's "
        "model.lora_rank / training.trainable, else 1)",
    )
    j.add_argument("--paro-group-size", type=int)
    j.add_argument("--hpz", type=int, help="hpZ partition size (default: DP ranks per node)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, required=True)
    c.add_argument("--gpus-per-node", type=int, required=True)
    c.add_argument("--accelerator", choices=sorted(ACCELERATORS))
    c.add_argument("--memory-gib", type=float)
    c.add_argument("--tflops", type=float, help="achievable TFLOP/s per accelerator")
    c.add_argument("--memory-bw-gbs", type=float, help="HBM GB/s")
    c.add_argument("--intra-gbs", type=float, help="intra-node GB/s per accelerator")
    c.add_argument("--inter-gbit", type=float, required=True, help="inter-node Gbit/s per node")
    c.add_argument("--intra-latency-us", type=float, default=5.0)
    c.add_argument("--inter-latency-us", type=float, default=15.0)
    c.add_argument("--usable-memory-fraction", type=float, default=0.9)
    c.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    o = p.add_argument_group("output")
    o.add_argument("--no-zeropp", action="store_true", help="plain PaRO strategies only")
    o.add_argument("--top", type=int, help="print only the first N rows")
    o.add_argument(
        "--no-two-level",
        action="store_true",
        help="leave out the two-level options (DiLoCo across islands of whole nodes)",
    )
    o.add_argument(
        "--tie",
        type=float,
        default=2.0,
        help="percent: options this close to the fastest count as tied; the smallest footprint wins",
    )
    return p


def _pick(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _cluster(a: argparse.Namespace) -> Cluster:
    acc = ACCELERATORS.get(a.accelerator)
    picked = {
        "memory_gib": _pick(a.memory_gib, acc.memory_gib if acc else None),
        "tflops": _pick(a.tflops, acc.achievable_tflops if acc else None),
        "memory_bw_gbs": _pick(a.memory_bw_gbs, acc.memory_bandwidth_gbs if acc else None),
        "intra_gbs": _pick(a.intra_gbs, acc.intra_gbs if acc else None),
    }
    missing = [f"--{k.replace('_', '-')}" for k, v in picked.items() if v is None]
    if missing:
        raise ConfigError(f"cluster: give {', '.join(missing)} or an --accelerator preset")
    values = {k: v for k, v in picked.items() if v is not None}
    return Cluster(
        nodes=a.nodes,
        gpus_per_node=a.gpus_per_node,
        memory_bytes=values["memory_gib"] * GIB,
        flops=values["tflops"] * 1e12,
        intra_bw=values["intra_gbs"] * 1e9,
        inter_bw=gbit(a.inter_gbit),
        intra_latency=a.intra_latency_us * 1e-6,
        inter_latency=a.inter_latency_us * 1e-6,
        memory_bw=values["memory_bw_gbs"] * 1e9,
        usable_memory_fraction=a.usable_memory_fraction,
        backend=a.backend,
    )


def _ffn_for(params: float, base: ModelConfig) -> int:
    """FFN width whose parameter count is closest to `params` (the count is linear in it)."""

    def count(ffn: int) -> int:
        return parameter_count(dataclasses.replace(base, ffn_hidden_size=ffn, moe_ffn_hidden_size=None))

    slope = (count(128) - count(64)) / 64
    return max(64, round((64 + (params - count(64)) / slope) / 64) * 64)


def _model(a: argparse.Namespace, base: Config | None) -> ModelConfig:
    if base is not None:
        return base.model
    need = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
    missing = ["--" + k.replace("_", "-") for k in need if getattr(a, k) is None]
    if missing:
        raise ConfigError(f"model: give --config or {', '.join(missing)}")
    cfg = model_config(a)
    if a.params is not None:
        if a.ffn_hidden_size is not None:
            raise ConfigError("give --params or --ffn-hidden-size, not both (--params sets the FFN width)")
        cfg = dataclasses.replace(cfg, ffn_hidden_size=_ffn_for(a.params, cfg), moe_ffn_hidden_size=None)
    return cfg


def _workload(a: argparse.Namespace) -> Workload:
    """The config's job (if any) with every flag given on the command line taking precedence."""
    base = load_config(["--config", a.config]) if a.config else None
    model = _model(a, base)
    job = (
        workload_of_config(base)
        if base
        else Workload(model=model, micro_batch=a.micro_batch_size, global_batch=a.global_batch_size)
    )
    flags = {
        "micro_batch": a.micro_batch_size,
        "global_batch": a.global_batch_size,
        "tp": a.tp,
        "pp": a.pp,
        "param_bytes": a.dtype and DTYPE_BYTES[a.dtype],
        "fp16": a.dtype and a.dtype == "fp16",
        "accum_bytes": a.grad_accum and DTYPE_BYTES[a.grad_accum],
        "activation_checkpointing": a.activation_checkpointing,
        "sequence_parallel": a.sequence_parallel,
        "paro_group_size": a.paro_group_size,
        "hpz_size": a.hpz,
    }
    job = dataclasses.replace(
        job,
        model=model,
        flash_attention=not a.no_flash_attention,
        **({"trainable_fraction": a.trainable_fraction} if a.trainable_fraction is not None else {}),
        **{k: v for k, v in flags.items() if v is not None},
    )
    if job.micro_batch is None or job.global_batch is None:
        raise ConfigError(
            "job: give --micro-batch-size and --global-batch-size (or a --config that sets "
            "training.micro_batch_size and training.global_batch_size)"
        )
    return job


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        cluster = _cluster(a)
        workload = _workload(a)
        shapes = shapes_of_config(
            workload.model,
            tp=workload.tp,
            pp=workload.pp,
            bucket_numel=workload.bucket_numel,
            threshold=workload.module_granularity_threshold,
            fetch_mode=workload.fetch_groups,
            trainable_fraction=workload.trainable_fraction,
            persistence=workload.persistence_threshold,
        )
        fixed = ZeroPP() if a.no_zeropp else None
        result = plan(shapes, workload, cluster, fixed_zeropp=fixed, tie=a.tie / 100)
        two_level = (
            None
            if a.no_two_level or cluster.nodes < 2
            else plan_two_level(shapes, workload, cluster, fixed_zeropp=fixed)
        )
    except MegazppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(result, workload, cluster) + f"; {parameter_count(workload.model) / 1e9:.2f} B parameters")
    print()
    print(table(result, a.top))
    print()
    print(f"Recommendation: {result.reason}")
    if two_level is not None:
        print()
        print(two_level_table(two_level, result))
        print()
        print(two_level_reason(two_level, result))
    return 0


if __name__ == "__main__":
    run_tool(main)
