"""pretrain_gpt.py on 2 gloo ranks in every layout it wires (DP through the ZeRO engine, TP,
TP with sequence parallelism, PP with 1F1B) reproduces the single-process run's losses:
within 1e-5 in fp32; for GPT-2's embedding tied across pipeline stages under bf16 (its
gradient synchronised in the fp32 accumulator), within bf16 rounding."""

from __future__ import annotations

import pytest
from support import TINY_MODEL_FLAGS, data_flags

import pretrain_gpt
from megazpp.launch.local_ranks import run_ranks

REFERENCES = {"llama_fp32": [], "gpt2_bf16": ["--arch", "gpt2", "--bf16"]}
LAYOUTS = {  # name: (flags, reference, tolerance)
    "dp2": ([], "llama_fp32", 1e-5),
    "dp2_zero2": (["--zero-stage", "2"], "llama_fp32", 1e-5),
    "tp2": (["--tensor-model-parallel-size", "2"], "llama_fp32", 1e-5),
    "tp2_sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "llama_fp32", 1e-5),
    "pp2": (["--pipeline-model-parallel-size", "2"], "llama_fp32", 1e-5),
    "pp2_gpt2_bf16": (["--pipeline-model-parallel-size", "2", *REFERENCES["gpt2_bf16"]], "gpt2_bf16", 2e-2),
}


def common_args(prefix: str, tokenizer: str) -> list[str]:
    return [
        *data_flags(prefix, tokenizer),
        *TINY_MODEL_FLAGS,
        "--global-batch-size",
        "8",
        "--lr",
        "1e-2",
        "--adam-eps",
        "1e-3",
        "--train-iters",
        "4",
        "--lr-warmup-iters",
        "1",
        "--eval-iters",
        "1",
        "--eval-interval",
        "2",
        "--log-interval",
        "100",
        "--seed",
        "5",
    ]


def _all_layouts(prefix: str, tokenizer: str) -> dict[str, tuple[dict, dict, int]]:
    from megazpp.parallel.counter import counter

    out = {}
    for name, (extra, _, _) in LAYOUTS.items():
        before = counter.run_totals()["intra"]
        history = pretrain_gpt.main(common_args(prefix, tokenizer) + extra)
        out[name] = (history.losses, history.val_losses, counter.run_totals()["intra"] - before)
    return out


def test_parallel_layouts_match_single_process(tiny_indexed_prefix, tiny_tokenizer_model):
    args = (str(tiny_indexed_prefix), str(tiny_tokenizer_model))
    references = {key: pretrain_gpt.main(common_args(*args) + flags) for key, flags in REFERENCES.items()}
    for reference in references.values():
        assert reference.losses[4] < reference.losses[1] - 0.05  # the steps change the model
    ranks = run_ranks(_all_layouts, 2, *args, timeout_s=300)
    for rank, results in enumerate(ranks):
        for name, (losses, val_losses, moved) in results.items():
            _, key, tol = LAYOUTS[name]
            reference = references[key]
            assert moved > 100_000, (rank, name, moved)  # the ranks really worked together
            assert sorted(losses) == [1, 2, 3, 4], (rank, name)
            for i, loss in losses.items():
                assert loss == pytest.approx(reference.losses[i], abs=tol), (rank, name, i)
            assert sorted(val_losses) == [2, 4], (rank, name)
            for i, loss in val_losses.items():
                assert loss == pytest.approx(reference.val_losses[i], abs=tol), (rank, name, i)
