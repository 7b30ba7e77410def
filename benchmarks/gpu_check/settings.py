"""What the device check runs: the model shape, the engine jobs, the loss bounds it judges them
by (each derived where it is set) and the targets it reports."""

from __future__ import annotations

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
# tools/plan.py at the end-to-end step's shape on one H100: the peak memory it predicts is what
# the measured peak is held to
PLAN_FLAGS = [
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
