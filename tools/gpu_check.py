"""One prepared device check: everything issue 30 asks of a GPU, in one run, with a report.

GPU machines are lent for minutes, so what needs one is prepared here and run as one command
(`tools/gpu_check.sh`, which installs a carried zstandard wheel first). Steps, in order:

1. kernels-bitwise   every Triton op on CUDA == the CPU reference, bit for bit
2. kernels-bandwidth bench_quant.py --devices cuda at 2^28 elements, each op vs copy bandwidth
3. data              run.sh's corpus, tokenizer and dataset under OUT/data (one CPU iteration)
4. engine            ZeRO-1, ZeRO-3, PaRO IGG, ZeRO-3 + qwZ + hpZ + qgZ + LoCo on 2-4 gloo
                     ranks sharing the GPU, each against the same job on CPU ranks (losses)
5. model-step        bench_model.py bf16 at Llama 24 x 2048 (GQA 16/8, seq 2048, mbs 4, vocab
                     32000) beside Hugging Face's Llama, then compiled (--compile)
6. end-to-end        run.sh --bf16 at the same shape (vocab 2048) against the bare step's
                     tokens/s (bench_model at vocab 2048) and the planner's predicted peak memory

A mismatch (a kernel bit, losses off the CPU job or the HF peer by more than the bound, a
failed or timed-out command) makes the exit status 1; a step skipped because the time budget
(--budget-s) ran out makes it 3; targets (85% of copy bandwidth, 68% MFU compiled, 95% of the
bare step's tokens/s, peak memory within 10% of the plan) are reported, met or not, and do not
change the status: they are measurements. OUT/report.md holds the summary and every number,
OUT/logs/ each command's output. `--dry-run` prints the plan, checks that every engine job's
flags form a valid config, and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

SHAPE = [
    "--num-layers",
    "24",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "16",
    "--num-query-groups",
    "8",
    "--seq-length",
    "2048",
    "--micro-batch-size",
    "4",
]
ENGINE_COMMON = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--train-iters",
    "5",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
]
# (name, ranks, flags): the strategies that run on ranks sharing one GPU
ENGINE_JOBS: list[tuple[str, int, list[str]]] = [
    ("zero1", 2, ["--zero-stage", "1"]),
    ("zero3", 2, ["--zero-stage", "3"]),
    ("paro-IGG", 4, ["--paro-strategy", "IGG", "--ranks-per-node", "2"]),
    (
        "zeropp-loco",
        4,
        [
            "--zero-stage",
            "3",
            "--zero-quantized-weights",
            "--zero-hpz-partition-size",
            "2",
            "--zero-quantized-gradients",
            "--loco",
            "--ranks-per-node",
            "2",
        ],
    ),
]
# Loss bounds, relative, CUDA ranks vs CPU ranks after 5 fp32 steps. Plain strategies: fp32
# reductions summed in another order (GPU matmul and softmax kernels) differ by a few ulps,
# ~1e-6 relative, and five Adam steps on a tiny model amplify that by far less than 100x.
# Quantized paths: one rounding difference can flip an int4/int8 code, moving a value by a
# quantization step (1/7 of its block's absmax for int4), so the bound is that of one step.
ENGINE_BOUND = {"zero1": 1e-4, "zero3": 1e-4, "paro-IGG": 1e-4, "zeropp-loco": 2e-2}
# bf16 first-step loss, megazpp vs the HF peer and compiled vs eager: bf16 keeps 8 bits
# (2^-8 relative per rounding) and the two compute the same function with other roundings;
# over 24 layers the loss (~10.4 = ln 32000) moves by far less than 0.5%.
PEER_BOUND = 5e-3
TARGETS = {"bandwidth": 0.85, "mfu_compiled": 0.68, "e2e_tokens": 0.95, "peak_memory": 0.10}


@dataclass
class Outcome:
    """A step's verdict: 'ok', 'MISMATCH', 'FAILED' (a command), 'skipped'; its report lines."""

    status: str
    summary: str
    lines: list[str] = field(default_factory=list)
    targets: list[tuple[str, bool, str]] = field(default_factory=list)  # (target, met, value)


@dataclass
class Context:
    out: Path
    deadline: float

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(extra)
        return env

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Job:
    """A started command, its output going to OUT/logs/NAME.log."""

    proc: subprocess.Popen
    log: Path
    timeout: float

    def collect(self) -> tuple[int, str]:
        """(exit status, output); 124 when it ran past its timeout (its process group killed)."""
        try:
            rc = self.proc.wait(timeout=max(1.0, self.timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            rc = 124
        return rc, self.log.read_text()


def start(ctx: Context, name: str, cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> Job:
    log = ctx.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        proc = subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            env=env or ctx.env(),
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    return Job(proc, log, timeout)


def run(
    ctx: Context, name: str, cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    return start(ctx, name, cmd, timeout, env).collect()


def tail(text: str, n: int = 15) -> list[str]:
    return ["```", *text.strip().splitlines()[-n:], "```"]


# --- parsers (tested on CPU output in tests/test_gpu_check.py) ---------------------------------


def bandwidth_rows(markdown: str) -> list[tuple[str, float]]:
    """(op, share of copy bandwidth) from bench_quant.py's CUDA table."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[4].endswith("%") and cells[4][:-1].isdigit():
            rows.append((cells[0], int(cells[4][:-1]) / 100))
    return rows


def last_json(text: str) -> dict:
    """The last line of `text` that is a JSON object (bench_model.py's result)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON result line in the output")


def log_lines(text: str) -> list[dict[str, float]]:
    """The trainer's console lines: iteration, loss, tokens/s, peak_mem (MiB) of each."""
    found = []
    for m in re.finditer(r"iter\s+(\d+)/\d+ \| loss ([\d.]+) .*?tokens/s (\d+) .*?peak_mem ([\d.]+) MiB", text):
        found.append({"iter": int(m[1]), "loss": float(m[2]), "tokens_per_s": float(m[3]), "peak_mib": float(m[4])})
    return found


def planned_peak_gib(table: str, strategy: str = "NNN") -> float:
    """The planner's predicted total GiB of `strategy` (tools/plan.py's table)."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 10 and cells[1].split()[0] == strategy:
            header = next(h for h in table.splitlines() if "total GiB" in h)
            names = [c.strip() for c in header.strip().strip("|").split("|")]
            return float(cells[names.index("total GiB")])
    raise ValueError(f"no row for {strategy} in the planner's table")


def tb_losses(directory: Path) -> list[float]:
    from megazpp.analysis.event_reader import read_run

    series = read_run(directory, directory.name).scalars["train/loss"]
    return [float(v) for v in series.values]


# --- steps ----------------------------------------------------------------------------------------


def step_kernels_bitwise(ctx: Context) -> Outcome:
    rc, text = run(ctx, "kernels-bitwise", [PY, "-m", "kernels.cuda_bitwise_check"], min(180, ctx.left()))
    fails = [line for line in text.splitlines() if line.startswith("FAIL")]
    summary = next((line for line in reversed(text.splitlines()) if "cases bit-identical" in line), "no summary")
    status = "MISMATCH" if fails else ("ok" if rc == 0 else "FAILED")
    return Outcome(status, summary, fails[:20] + ([] if rc == 0 or fails else tail(text)))


def step_kernels_bandwidth(ctx: Context) -> Outcome:
    rc, text = run(
        ctx,
        "kernels-bandwidth",
        [PY, "tools/bench_quant.py", "--devices", "cuda", "--numel", str(2**28), "--iters", "10"],
        min(150, ctx.left()),
    )
    if rc != 0:
        return Outcome("FAILED", f"bench_quant.py exited {rc}", tail(text))
    rows = bandwidth_rows(text)
    low = [op for op, share in rows if share < TARGETS["bandwidth"]]
    table = [line for line in text.splitlines() if line.startswith(("|", "Copy", "###"))]
    return Outcome(
        "ok",
        f"{len(rows)} ops, {len(rows) - len(low)} at >= 85% of copy",
        table,
        [(f"{op} >= 85% of copy", share >= TARGETS["bandwidth"], f"{share:.0%}") for op, share in rows],
    )


def _run_sh(ctx: Context, name: str, flags: list[str], *, ranks: int, gpu: bool, timeout: float) -> Job:
    """`bash run.sh FLAGS` on `ranks` ranks of this node, on the GPU or (CUDA hidden) on CPU
    ranks, data under OUT/data, TensorBoard under OUT/tb/NAME, no checkpoints."""
    env = ctx.env(DATA_DIR=str(ctx.out / "data"), NPROC_PER_NODE=str(ranks))
    if ranks > 1:  # eight jobs share the machine's cores (run.sh sets 1 for CPU ranks itself)
        env["OMP_NUM_THREADS"] = "1"
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = ["bash", "run.sh", *flags, "--tensorboard-dir", str(ctx.out / "tb" / name), "--save", "none"]
    return start(ctx, name, cmd, timeout, env)


def step_data(ctx: Context) -> Outcome:
    rc, text = _run_sh(
        ctx,
        "data",
        ["--train-iters", "1", "--log-interval", "1", "--eval-interval", "1000"],
        ranks=1,
        gpu=False,
        timeout=min(240, ctx.left()),
    ).collect()
    return Outcome(
        "ok" if rc == 0 else "FAILED",
        f"corpus, tokenizer and dataset under {ctx.out / 'data'}",
        [] if rc == 0 else tail(text),
    )


def step_engine(ctx: Context) -> Outcome:
    """Every job on CUDA ranks (gloo, sharing the GPU) and on CPU ranks at once; losses compared."""
    procs = {}
    for name, ranks, flags in ENGINE_JOBS:
        for gpu in (True, False):
            extra = ["--distributed-backend", "gloo"] if gpu else []
            label = f"engine-{name}-{'cuda' if gpu else 'cpu'}"
            procs[label] = _run_sh(
                ctx, label, ENGINE_COMMON + flags + extra, ranks=ranks, gpu=gpu, timeout=min(300, ctx.left())
            )
    results = {label: job.collect() for label, job in procs.items()}
    lines = ["| job | ranks | CUDA losses | CPU losses | max relative gap | bound |", "|---|---:|---|---|---:|---:|"]
    status, worst, failures = "ok", [], []
    for name, ranks, _ in ENGINE_JOBS:
        cuda, cpu = results[f"engine-{name}-cuda"], results[f"engine-{name}-cpu"]
        if cuda[0] != 0 or cpu[0] != 0:
            status = "FAILED"
            lines.append(f"| {name} | {ranks} | exit {cuda[0]} | exit {cpu[0]} | | |")
            failures += [
                f"{label}, exit {rc}:"
                for label, (rc, _) in ((f"{name} on CUDA", cuda), (f"{name} on CPU", cpu))
                if rc != 0
            ]
            failures += [line for rc, text in (cuda, cpu) if rc != 0 for line in tail(text, 12)]
            continue
        a = tb_losses(ctx.out / "tb" / f"engine-{name}-cuda")
        b = tb_losses(ctx.out / "tb" / f"engine-{name}-cpu")
        gap = max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")
        if gap > ENGINE_BOUND[name]:
            status = "MISMATCH" if status == "ok" else status
            worst.append(name)
        lines.append(
            f"| {name} | {ranks} | {', '.join(f'{x:.6f}' for x in a)} | {', '.join(f'{x:.6f}' for x in b)} "
            f"| {gap:.2e} | {ENGINE_BOUND[name]:.0e} |"
        )
    summary = f"{len(ENGINE_JOBS)} jobs on CUDA ranks sharing the GPU vs CPU ranks" + (
        f"; outside the bound: {', '.join(worst)}" if worst else ""
    )
    return Outcome(status, summary, lines + ([""] + failures if failures else []))


def step_model(ctx: Context) -> Outcome:
    bench = [
        PY,
        "tools/bench_model.py",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        *SHAPE,
        "--vocab-size",
        "32000",
        "--warmup",
        "2",
        "--steps",
        "4",
        "--peak-size",
        "8192",
    ]
    rc, text = run(ctx, "model-step", bench + ["--peer", "hf"], min(300, ctx.left()))
    if rc != 0:
        return Outcome("FAILED", f"bench_model.py exited {rc}", tail(text))
    eager = last_json(text)
    rc, text = run(ctx, "model-step-compiled", bench + ["--peer", "none", "--compile"], min(300, ctx.left()))
    if rc != 0:
        return Outcome("FAILED", f"bench_model.py --compile exited {rc}", tail(text))
    compiled = last_json(text)
    peer = eager.get("peer", {})
    gaps = {
        "HF peer": abs(peer.get("first_loss", float("inf")) - eager["first_loss"]) / eager["first_loss"],
        "compiled": abs(compiled["first_loss"] - eager["first_loss"]) / eager["first_loss"],
    }
    lines = [
        "| model | tokens/s | MFU | first loss |",
        "|---|---:|---:|---:|",
        f"| megazpp | {eager['tokens_per_s']} | {eager['mfu']:.1%} | {eager['first_loss']:.5f} |",
        f"| megazpp compiled | {compiled['tokens_per_s']} | {compiled['mfu']:.1%} | {compiled['first_loss']:.5f} |",
        f"| HF LlamaForCausalLM | {peer.get('tokens_per_s')} | {peer.get('mfu', 0):.1%} | "
        f"{peer.get('first_loss', float('nan')):.5f} |",
        "",
        f"matmul peak {eager['matmul_peak_tflops']} TFLOP/s; first-loss gaps (relative): "
        + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items())
        + f" (bound {PEER_BOUND:.0e})",
    ]
    status = "ok" if all(g <= PEER_BOUND for g in gaps.values()) else "MISMATCH"
    return Outcome(
        status,
        f"MFU {eager['mfu']:.1%} eager, {compiled['mfu']:.1%} compiled, HF {peer.get('mfu', 0):.1%}",
        lines,
        [("compiled step >= 68% MFU", compiled["mfu"] >= TARGETS["mfu_compiled"], f"{compiled['mfu']:.1%}")],
    )


def step_end_to_end(ctx: Context) -> Outcome:
    rc, text = run(
        ctx,
        "bare-step",
        [
            PY,
            "tools/bench_model.py",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            *SHAPE,
            "--vocab-size",
            "2048",
            "--peer",
            "none",
            "--warmup",
            "2",
            "--steps",
            "5",
            "--peak-size",
            "8192",
        ],
        min(180, ctx.left()),
    )
    if rc != 0:
        return Outcome("FAILED", f"bare step exited {rc}", tail(text))
    bare = last_json(text)
    flags = [
        "--bf16",
        *SHAPE,
        "--global-batch-size",
        "4",
        "--train-iters",
        "30",
        "--log-interval",
        "5",
        "--eval-interval",
        "1000",
    ]
    rc, text = _run_sh(ctx, "end-to-end", flags, ranks=1, gpu=True, timeout=min(300, ctx.left())).collect()
    logged = log_lines(text)
    if rc != 0 or not logged:
        return Outcome("FAILED", f"run.sh --bf16 exited {rc}", tail(text))
    rc, plan = run(
        ctx,
        "plan",
        [
            PY,
            "tools/plan.py",
            *SHAPE,
            "--vocab-size",
            "2048",
            "--global-batch-size",
            "4",
            "--dtype",
            "bf16",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--inter-gbit",
            "100",
            "--accelerator",
            "h100-80gb",
        ],
        min(60, ctx.left()),
    )
    predicted = planned_peak_gib(plan) if rc == 0 else float("nan")
    steady = logged[-1]
    ratio = steady["tokens_per_s"] / bare["tokens_per_s"]
    peak_gib = steady["peak_mib"] / 1024
    off = abs(peak_gib - predicted) / predicted
    lines = [
        f"bare step: {bare['tokens_per_s']} tokens/s ({bare['mfu']:.1%} MFU); run.sh --bf16 last logged "
        f"interval: {steady['tokens_per_s']:.0f} tokens/s ({ratio:.1%} of the bare step), peak "
        f"{peak_gib:.2f} GiB against the planner's {predicted:.2f} GiB (NNN)",
        *tail(text, 8),
    ]
    return Outcome(
        "ok",
        f"{ratio:.1%} of the bare step's tokens/s; peak {peak_gib:.1f} GiB vs planned {predicted:.1f} GiB",
        lines,
        [
            ("end to end >= 95% of the bare step's tokens/s", ratio >= TARGETS["e2e_tokens"], f"{ratio:.1%}"),
            ("peak memory within 10% of the plan", off <= TARGETS["peak_memory"], f"{off:+.1%}"),
        ],
    )


STEPS: list[tuple[str, str, int, Callable[[Context], Outcome]]] = [
    ("kernels-bitwise", "python -m kernels.cuda_bitwise_check", 75, step_kernels_bitwise),
    (
        "kernels-bandwidth",
        "python tools/bench_quant.py --devices cuda --numel 268435456 --iters 10",
        25,
        step_kernels_bandwidth,
    ),
    ("data", "DATA_DIR=OUT/data CUDA_VISIBLE_DEVICES= bash run.sh --train-iters 1 (builds the dataset)", 50, step_data),
    (
        "engine",
        "8 run.sh jobs at once: "
        + ", ".join(f"{n} ({r} ranks)" for n, r, _ in ENGINE_JOBS)
        + " on CUDA ranks (--distributed-backend gloo) and on CPU ranks",
        80,
        step_engine,
    ),
    (
        "model-step",
        "tools/bench_model.py --device cuda --dtype bf16 "
        + " ".join(SHAPE)
        + " --vocab-size 32000 --peer hf; again with --compile --peer none",
        140,
        step_model,
    ),
    (
        "end-to-end",
        "tools/bench_model.py (vocab 2048, --peer none); bash run.sh --bf16 "
        + " ".join(SHAPE)
        + " --train-iters 30; tools/plan.py at that shape",
        90,
        step_end_to_end,
    ),
]


def dry_run() -> int:
    """Print the plan and check every engine job's flags form a valid config (no GPU needed)."""
    from megazpp.config.checks import check_config
    from megazpp.config.load import load_config

    print("tools/gpu_check.sh plan (estimated seconds on one H100 / H200; budget --budget-s):")
    for name, what, seconds, _ in STEPS:
        print(f"  {name:18s} ~{seconds:>4d} s  {what}")
    print(f"  total ~{sum(s for _, _, s, _ in STEPS)} s")
    for name, ranks, flags in ENGINE_JOBS:
        cfg = load_config(ENGINE_COMMON + flags + ["--distributed-backend", "gloo"])
        check_config(cfg, ranks)  # every subsystem's options, the engine's included
        print(f"  engine job {name}: {ranks} ranks, flags valid: {' '.join(flags)}")
    for path in (
        "run.sh",
        "tools/bench_quant.py",
        "tools/bench_model.py",
        "tools/plan.py",
        "kernels/cuda_bitwise_check.py",
    ):
        if not (ROOT / path).exists():
            print(f"missing {path}")
            return 1
    print("dry run: plan printed, engine flags valid; nothing was run")
    return 0


def write_report(out: Path, outcomes: list[tuple[str, Outcome, float]]) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    commit = (
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        or "unknown"
    )
    lines = [
        f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"{device}; torch {torch.__version__}, Triton {triton_version}; commit {commit}.",
        "",
        "| step | status | result | seconds |",
        "|---|---|---|---:|",
    ]
    lines += [f"| {name} | {o.status} | {o.summary} | {s:.0f} |" for name, o, s in outcomes]
    targets = [t for _, o, _ in outcomes for t in o.targets]
    if targets:
        lines += [
            "",
            "## Targets (measurements; they do not change the exit status)",
            "",
            "| target | met | value |",
            "|---|---|---:|",
        ]
        lines += [f"| {t} | {'yes' if met else 'no'} | {value} |" for t, met, value in targets]
    for name, o, _ in outcomes:
        lines += ["", f"## {name}: {o.status}", "", o.summary, "", *o.lines]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu_check", help="report, logs, data and runs go here")
    parser.add_argument("--budget-s", type=float, default=470, help="skip steps once this much time is spent")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; run nothing (no GPU needed)")
    parser.add_argument("--wheels", default=None, help="(handled by gpu_check.sh) local wheel directory")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to see the plan)", file=sys.stderr)
        return 1
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out, time.monotonic() + args.budget_s)
    outcomes: list[tuple[str, Outcome, float]] = []
    for name, _, estimate, fn in STEPS:
        started = time.monotonic()
        if ctx.left() < min(estimate, 60):
            outcome = Outcome("skipped", f"{ctx.left():.0f} s of the budget left, ~{estimate} s needed")
        else:
            try:
                outcome = fn(ctx)
            except Exception as exc:  # a parse or read failure is a failed step, not a lost report
                outcome = Outcome("FAILED", f"{type(exc).__name__}: {exc}")
        outcomes.append((name, outcome, time.monotonic() - started))
        print(f"{name}: {outcome.status}: {outcome.summary}", flush=True)
        write_report(out, outcomes)
    statuses = {o.status for _, o, _ in outcomes}
    print(f"report: {out / 'report.md'}")
    return 1 if statuses & {"MISMATCH", "FAILED"} else 3 if "skipped" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
