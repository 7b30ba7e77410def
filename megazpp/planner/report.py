"""The plan as a Markdown table: what tools/plan.py prints and `paro_strategy: auto` logs."""

from __future__ import annotations

from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.plan import Plan
from megazpp.planner.workload import Workload


def _g(x: float) -> str:
    return f"{x / GIB:.2f}"


def table(p: Plan, limit: int | None = None) -> str:
    """One row per option, fastest fitting first; memory in GiB per rank, bytes in GB per step."""
    head = ["| # | option | fits | params | grads | optim | ZeRO++ state | frozen | activations | "
            "buffers | total GiB | intra GB/step | inter GB/step | calls/step | compute s | "
            "exposed s | step s |", "|" + "---|" * 17]
    lines = []
    for i, row in enumerate(p.rows[:limit] if limit else p.rows, 1):
        m, c = row.fullest, row.critical
        mark = " **<-**" if row is p.choice else ""
        lines.append(f"| {i} | {row.name}{mark} | {'yes' if row.fits else 'NO'} | {_g(m.state.params)} | "
                     f"{_g(m.state.grads)} | {_g(m.state.optimizer)} | {_g(m.state.path_state)} | "
                     f"{_g(m.frozen_bytes)} | {_g(m.activation_bytes)} | {_g(m.transient_bytes)} | "
                     f"{_g(row.memory_bytes)} | {c.step_bytes[0] / 1e9:.3f} | {c.step_bytes[1] / 1e9:.3f} | "
                     f"{c.calls} | {c.compute_s:.3f} | {c.exposed_s:.3f} | {row.step_s:.3f} |")
    return "\n".join(head + lines)


def summary(p: Plan, workload: Workload, cluster: Cluster) -> str:
    """Header lines: the job and the machine as the planner understood them."""
    d = workload.dp(cluster)
    cfg = workload.model
    return (f"{cluster.nodes} nodes x {cluster.gpus_per_node} accelerators ({cluster.memory_bytes / GIB:.0f} GiB, "
            f"{cluster.flops / 1e12:.3g} TFLOP/s achievable), intra {cluster.intra_bw / 1e9:.1f} GB/s per "
            f"accelerator, inter {cluster.inter_bw * 8 / 1e9:.1f} Gbit/s per node; TP {workload.tp} x PP "
            f"{workload.pp} x DP {d}; {cfg.arch} {cfg.num_layers} layers, hidden {cfg.hidden_size}, seq "
            f"{cfg.seq_length}, vocab {cfg.vocab_size}; micro-batch {workload.micro_batch} x "
            f"{workload.micro_batches(cluster)} accumulation steps, global batch {workload.global_batch}; "
            f"{workload.param_bytes}-byte weights, {workload.accum_bytes}-byte gradient accumulation"
            f"{', activation checkpointing' if workload.activation_checkpointing else ''}"
            f"{f', trainable fraction {workload.trainable_fraction:g}' if workload.trainable_fraction < 1 else ''}"
            f"{' (frozen weights sharded at p)' if workload.trainable_fraction < 1 else ''}")
