"""Single-process training throughput and MFU of a GPT/Llama model on this machine.

MFU is measured against a peak taken in the same run, from torch.matmul on large square
matrices of the same dtype, so the figure says how close the whole training step (forward,
backward, optimizer) comes to what this machine's matmul can do, independent of its clock
or core count. Model FLOPs per token are megazpp.model.flops.training_flops_per_token
(6N + attention, the PaLM/Megatron convention).

    python tools/bench_model.py                      # 6-layer, 512-wide Llama, seq 512
    python tools/bench_model.py --num-layers 2 --hidden-size 64 --seq-length 64 --steps 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megazpp.cli import run_tool
from megazpp.model.config import ModelConfig
from megazpp.model.flops import training_flops_per_token
from megazpp.model.gpt import GPTModel
from megazpp.tool_flags import add_shape_flags, model_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak_flops(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best FLOP/s of an n x n @ n x n matmul over `repeats` timed runs (after one warm-up)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def training_tokens_per_second(cfg: ModelConfig, micro_batch: int, dtype: torch.dtype,
                               warmup: int, steps: int) -> float:
    """Tokens/s of full training steps (forward, backward, AdamW step) on a fixed batch."""
    model = GPTModel(cfg).to(dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        model(inputs, labels).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * micro_batch * cfg.seq_length / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_flags(parser, {"arch": "llama", "num_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
                             "num_query_groups": None, "vocab_size": 32000, "seq_length": 512,
                             "micro_batch_size": 4})
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-size", type=int, default=4096, help="side of the square matmul")
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = model_config(args, activation_checkpointing=args.activation_checkpointing)
    dtype = DTYPES[args.dtype]
    peak = matmul_peak_flops(args.peak_size, dtype, args.peak_repeats)
    tokens_per_s = training_tokens_per_second(cfg, args.micro_batch_size, dtype, args.warmup,
                                              args.steps)
    achieved = training_flops_per_token(cfg) * tokens_per_s
    result = {
        "arch": cfg.arch, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "seq_length": cfg.seq_length, "micro_batch_size": args.micro_batch_size,
        "vocab_size": cfg.vocab_size, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "tokens_per_s": round(tokens_per_s, 1),
        "model_tflops": round(achieved / 1e12, 4),
        "matmul_peak_tflops": round(peak / 1e12, 4),
        "mfu": round(achieved / peak, 4),
    }
    print(f"{cfg.arch} {cfg.num_layers}x{cfg.hidden_size} seq {cfg.seq_length} "
          f"mbs {args.micro_batch_size} {args.dtype}, {result['threads']} threads: "
          f"{tokens_per_s:.1f} tokens/s, {achieved / 1e9:.2f} GFLOP/s model, "
          f"matmul peak {peak / 1e9:.2f} GFLOP/s, MFU {100 * achieved / peak:.1f}%")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_tool(main)
