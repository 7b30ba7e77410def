"""The plan as a Markdown table: what tools/plan.py prints and `paro_strategy: auto` logs."""

from __future__ import annotations

from megazpp.planner.cluster import GIB, Cluster
from megazpp.planner.plan import Plan
from megazpp.planner.two_level import IslandPlan, TwoLevelPlan, digest
from megazpp.planner.workload import Workload

# why a cluster gets no two-level row
NO_TWO_LEVEL = "fewer than 2 islands of whole nodes, nothing fits, or the run ends before any H in the list syncs"


def _g(x: float) -> str:
    return f"{x / GIB:.2f}"


def table(p: Plan, limit: int | None = None) -> str:
    """One row per option, fastest fitting first; memory in GiB per rank, bytes in GB per step."""
    head = [
        "| # | option | fits | params | grads | optim | ZeRO++ state | frozen | activations | "
        "buffers | total GiB | intra GB/step | inter GB/step | calls/step | compute s | "
        "exposed s | step s |",
        "|" + "---|" * 17,
    ]
    lines = []
    for i, row in enumerate(p.rows[:limit] if limit else p.rows, 1):
        m, c = row.fullest, row.critical
        mark = " **<-**" if row is p.choice else ""
        lines.append(
            f"| {i} | {row.name}{mark} | {'yes' if row.fits else 'NO'} | {_g(m.state.params)} | "
            f"{_g(m.state.grads)} | {_g(m.state.optimizer)} | {_g(m.state.path_state)} | "
            f"{_g(m.frozen_bytes)} | {_g(m.activation_bytes)} | {_g(m.transient_bytes)} | "
            f"{_g(row.memory_bytes)} | {c.step_bytes[0] / 1e9:.3f} | {c.step_bytes[1] / 1e9:.3f} | "
            f"{c.calls} | {c.compute_s:.3f} | {c.exposed_s:.3f} | {row.step_s:.3f} |"
        )
    return "\n".join(head + lines)


def summary(p: Plan, workload: Workload, cluster: Cluster) -> str:
    """Header lines: the job and the machine as the planner understood them."""
    d = workload.dp(cluster)
    cfg = workload.model
    return (
        f"{cluster.nodes} nodes x {cluster.gpus_per_node} accelerators ({cluster.memory_bytes / GIB:.0f} GiB, "
        f"{cluster.flops / 1e12:.3g} TFLOP/s achievable), intra {cluster.intra_bw / 1e9:.1f} GB/s per "
        f"accelerator, inter {cluster.inter_bw * 8 / 1e9:.1f} Gbit/s per node; TP {workload.tp} x PP "
        f"{workload.pp} x DP {d}; {cfg.arch} {cfg.num_layers} layers, hidden {cfg.hidden_size}, seq "
        f"{cfg.seq_length}, vocab {cfg.vocab_size}; micro-batch {workload.micro_batch} x "
        f"{workload.micro_batches(cluster)} accumulation steps, global batch {workload.global_batch}; "
        f"{workload.param_bytes}-byte weights, {workload.accum_bytes}-byte gradient accumulation"
        f"{', activation checkpointing' if workload.activation_checkpointing else ''}"
        f"{f', trainable fraction {workload.trainable_fraction:g}' if workload.trainable_fraction < 1 else ''}"
        f"{' (frozen weights sharded at p)' if workload.trainable_fraction < 1 else ''}"
    )


def two_level_table(tp: TwoLevelPlan, synchronous: Plan) -> str:
    """The two-level rows (`two_level.digest`) beside the best synchronous option's step time;
    headed by what they are: a different optimisation, not the same training made faster."""
    best = synchronous.choice.step_s if synchronous.choice else None
    head = [
        "Two-level options (DiLoCo across islands: they CHANGE THE OPTIMISATION, the losses are not "
        "those of the synchronous rows above; outer GB per rank, mean per inner step and the peak step):",
        "",
        "| # | option | fits | outer GiB | total GiB | outer inter GB/step | peak GB | inner step s | "
        "exposed outer s | step s | vs best synchronous |",
        "|" + "---|" * 11,
    ]
    lines = []
    for i, row in enumerate(digest(tp), 1):
        mark = " **<-**" if row is tp.choice else ""
        state = max(o.state_bytes for o in row.stages)
        speed = f"{best / row.step_s:.2f}x" if best else "n/a"
        lines.append(
            f"| {i} | {row.name}{mark} | {'yes' if row.fits else 'NO'} | {_g(state)} | "
            f"{_g(row.memory_bytes)} | {row.mean_inter_bytes / 1e9:.3f} | {row.peak_inter_bytes / 1e9:.3f} | "
            f"{row.inner_step_s:.3f} | {row.exposed_s:.3f} | {row.step_s:.3f} | {speed} |"
        )
    if not lines:
        return f"Two-level options: none ({NO_TWO_LEVEL})."
    return "\n".join(head + lines)


def two_level_reason(tp: TwoLevelPlan, synchronous: Plan) -> str:
    """One line: the recommended two-level setting, its flags, and why."""
    c = tp.choice
    if c is None:
        return f"Two-level recommendation: none ({NO_TWO_LEVEL})."
    rule = (
        "the smallest H whose outer traffic costs at most 10 % of the inner step, with the least compression"
        if c.within_budget
        else "no setting keeps the outer traffic within 10 % of the inner step; the fastest"
    )
    best = synchronous.choice.step_s if synchronous.choice else None
    versus = f", {best / c.step_s:.2f}x the best synchronous option ({best:.3f} s)" if best else ""
    return (
        f"Two-level recommendation (changes the optimisation): {c.outer.name}, {c.inner.name} inside each island, "
        f"predicted {c.step_s:.3f} s/step (inner {c.inner_step_s:.3f} s + exposed outer {c.exposed_s:.3f} s)"
        f"{versus}; {rule}; flags: {c.outer.flags()}"
    )


def island_table(ip: IslandPlan) -> str:
    """`paro_strategy: auto` with islands: every option of the island under the run's outer
    setting, as the two-level job it makes (memory with the outer state; step = inner + exposed
    outer)."""
    head = [
        f"Island options under {ip.outer.name}:",
        "",
        "| # | island option | fits | outer GiB | total GiB | inner inter GB/step | outer inter GB/step | "
        "inner step s | exposed outer s | step s |",
        "|" + "---|" * 10,
    ]
    lines = []
    for i, row in enumerate(ip.rows, 1):
        mark = " **<-**" if row is ip.choice else ""
        lines.append(
            f"| {i} | {row.inner.name}{mark} | {'yes' if row.fits else 'NO'} | "
            f"{_g(max(o.state_bytes for o in row.stages))} | {_g(row.memory_bytes)} | "
            f"{row.inner.critical.step_bytes[1] / 1e9:.3f} | {row.mean_inter_bytes / 1e9:.4f} | "
            f"{row.inner_step_s:.3f} | {row.exposed_s:.3f} | {row.step_s:.3f} |"
        )
    return "\n".join(head + lines)


def measured_inputs(c: Cluster, inter_given: bool, probed_inter: float) -> str:
    """Every input a calibration's predictions used, as measured on the cluster (tools/
    calibrate_planner.py, tools/bench_netlab_check.py); `probed_inter`: the node's probed
    inter-node bytes/s, shown beside a given rate."""
    probed = ", ".join(
        f"{k} {'/'.join(f'{t * 1e3:.2f}' for _, t in v)}" for k, v in sorted((c.collective_times or {}).items())
    )
    adam = f"{c.optimizer_rate / 1e6:.0f} M elements/s" if c.optimizer_rate else "memory bound"
    return (
        f"Measured inputs: {c.flops / 1e9:.2f} GFLOP/s per rank, memory {c.memory_bw / 1e9:.1f} GB/s, intra "
        f"{c.intra_bw / 1e9:.3f} GB/s ({c.intra_latency * 1e6:.0f} us), inter {c.inter_bw * 8 / 1e9:.3f} "
        f"Gbit/s per node ({'given' if inter_given else 'probed'}; probed {probed_inter * 8 / 1e9:.3f}), "
        f"{c.inter_latency * 1e6:.0f} us; AdamW {adam}; overlap model {'on' if c.overlap else 'off'}; "
        f"collectives (ms per call at 4 KiB / 256 KiB / 4 MiB per member): {probed or 'not probed'}"
    )


PredictionRow = tuple[str, float, float, dict[str, float]]  # name, predicted s, measured s, terms


def prediction_table(kind: str, rows: list[PredictionRow]) -> tuple[list[str], list[float]]:
    """The calibration tools' table of predicted against measured seconds per step, one line a
    `kind` (strategy, two-level row), and each row's relative error."""
    lines = [f"| {kind} | predicted s/step | measured s/step | error |", "|---|---|---|---|"]
    errors = [predicted / measured - 1 for _, predicted, measured, _ in rows]
    lines += [
        f"| {name} | {predicted:.4f} | {measured:.4f} | {100 * e:+.1f} % |"
        for (name, predicted, measured, _), e in zip(rows, errors)
    ]
    return lines, errors


def term_breakdown(rows: list[PredictionRow]) -> list[str]:
    """Each prediction's nonzero terms (`--breakdown`)."""
    return ["", "Predicted seconds per step, by term:"] + [
        f"  {name}: " + " ".join(f"{k}={v:.4f}" for k, v in terms.items() if v) for name, _, _, terms in rows
    ]
