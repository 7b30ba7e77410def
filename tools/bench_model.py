"""Single-process training throughput and MFU of a GPT/Llama model, beside Hugging Face's Llama.

MFU is measured against a peak taken in the same run, from torch.matmul on large square
matrices of the same dtype, so the figure says how close the whole training step (forward,
backward, optimizer) comes to what this machine's matmul can do, independent of its clock
or core count. Model FLOPs per token are megazpp.model.flops.training_flops_per_token
(6N + attention, the PaLM/Megatron convention).

With transformers installed and a Llama shape, the same step of `LlamaForCausalLM` (same
weights, batch, dtype and fused AdamW: benchmarks.hf_peer) is timed in the same run, and
both models' losses on the batch before any update are reported (they must agree to rounding).
`--compile` compiles megazpp's layers (training.compile); `--device cuda` runs on the GPU.

    python tools/bench_model.py                      # 6-layer, 512-wide Llama, seq 512
    python tools/bench_model.py --num-layers 2 --hidden-size 64 --seq-length 64 --steps 2
    python tools/bench_model.py --device cuda --dtype bf16 --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --num-query-groups 8 --seq-length 2048 --compile
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import checkout_path  # noqa: F401  (benchmarks/ from this checkout: it is not installed)
import torch
from torch import nn

from benchmarks.hf_peer import hf_peer, peer_available, peer_loss
from megazpp.cli import run_tool
from megazpp.config.tool_flags import add_shape_flags, model_config
from megazpp.model.compile import compile_layers
from megazpp.model.flops import training_flops_per_token
from megazpp.model.gpt import GPTModel
from megazpp.unique_keys import JSONObject

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(n: int, dtype: torch.dtype, repeats: int, device: torch.device) -> float:
    """Best FLOP/s of an n x n @ n x n matmul over `repeats` timed runs (after one warm-up)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def tokens_per_second(
    model: nn.Module, loss_of: Callable[[], torch.Tensor], tokens: int, device: torch.device, warmup: int, steps: int
) -> tuple[float, float]:
    """(tokens/s of full training steps: forward, backward, fused AdamW; the loss of the first
    step, before any update)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> torch.Tensor:
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = step().item()
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return steps * tokens / (time.perf_counter() - start), first


def main(argv: list[str] | None = None) -> JSONObject:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_flags(
        parser,
        {
            "arch": "llama",
            "num_layers": 6,
            "hidden_size": 512,
            "num_attention_heads": 8,
            "num_query_groups": None,
            "vocab_size": 32000,
            "seq_length": 512,
            "micro_batch_size": 4,
        },
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile megazpp's layers (training.compile)")
    parser.add_argument(
        "--peer",
        choices=("auto", "hf", "none"),
        default="auto",
        help="Hugging Face LlamaForCausalLM beside megazpp (auto: when transformers is installed)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-size", type=int, default=4096, help="side of the square matmul")
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    cfg = model_config(args, activation_checkpointing=args.activation_checkpointing)
    if args.peer == "hf" and not peer_available(cfg):
        parser.error("--peer hf: needs --arch llama and the transformers package (pip install -e .[interop])")
    run_peer = args.peer == "hf" or (args.peer == "auto" and peer_available(cfg))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    peak = matmul_peak_flops(args.peak_size, dtype, args.peak_repeats, device)
    model = GPTModel(cfg).to(device=device, dtype=dtype).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, cfg.seq_length + 1), generator=g).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    tokens = args.micro_batch_size * cfg.seq_length
    flops_per_token = training_flops_per_token(cfg)
    peer = hf_peer(model, cfg) if run_peer else None  # before megazpp's first update: same weights
    if args.compile:
        compile_layers(model.layers)
    rate, loss = tokens_per_second(model, lambda: model(inputs, labels).mean(), tokens, device, args.warmup, args.steps)
    result = {
        "arch": cfg.arch,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "seq_length": cfg.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "vocab_size": cfg.vocab_size,
        "dtype": args.dtype,
        "device": args.device,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "tokens_per_s": round(rate, 1),
        "model_tflops": round(flops_per_token * rate / 1e12, 4),
        "matmul_peak_tflops": round(peak / 1e12, 4),
        "mfu": round(flops_per_token * rate / peak, 4),
        "first_loss": loss,
    }
    name = "cuda" if device.type == "cuda" else f"{result['threads']} threads"
    print(
        f"{cfg.arch} {cfg.num_layers}x{cfg.hidden_size} seq {cfg.seq_length} mbs {args.micro_batch_size} "
        f"{args.dtype}, {name}: matmul peak {peak / 1e9:.2f} GFLOP/s"
    )
    print(
        f"  megazpp{' (compiled)' if args.compile else ''}: {rate:.1f} tokens/s, "
        f"{flops_per_token * rate / 1e9:.2f} GFLOP/s, MFU {100 * result['mfu']:.1f}%, first loss {loss:.6f}"
    )
    if peer is not None:
        del model  # the peer's step gets the memory megazpp's used
        peer_rate, peer_first = tokens_per_second(
            peer, lambda: peer_loss(peer, inputs, labels), tokens, device, args.warmup, args.steps
        )
        result["peer"] = {
            "name": "transformers LlamaForCausalLM",
            "tokens_per_s": round(peer_rate, 1),
            "mfu": round(flops_per_token * peer_rate / peak, 4),
            "first_loss": peer_first,
        }
        print(
            f"  HF Llama: {peer_rate:.1f} tokens/s, MFU {100 * result['peer']['mfu']:.1f}%, first loss {peer_first:.6f}"
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_tool(main)
