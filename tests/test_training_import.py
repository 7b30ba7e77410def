"""Training from an imported (weights-only) checkpoint written by megazpp.interop: the weights
are loaded before the engine copies them into its fp32 masters, the run starts at iteration 0,
any data-parallel size reads DP rank 0's file, and a restarted fine-tune resumes from its own
--save rather than from the imported weights again."""

from __future__ import annotations

import dataclasses

import pytest
from support import QUIET_FLAGS
from test_training_pretrain import tiny_args

import pretrain_gpt
from megazpp.config.load import load_config
from megazpp.interop.checkpoint_io import write_weights_checkpoint
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.gpt import GPTModel

SOURCE_SEED = 77
# step 3 of two DP ranks against one rank: the runs differ only in the order the ranks' fp32
# gradients are summed (relative 2^-24), which through two AdamW steps can at most flip the bf16
# rounding of single weights (one bf16 step, 2^-8 of a weight of ~0.02); the fp32 loss near
# ln 512 moves by a few of its ulps (4.8e-7) for that (seen: one ulp). 1e-3 keeps three orders
# of that margin and is 9x below what a one-head slip of one layer's qkv rows makes (9.3e-3;
# another initialisation: 1.3e-2, both of which the former 2e-2 let through)
STEP3_TOL = 1e-3


def _import(tmp_path, prefix, tokenizer, name="imported", wrong: str | None = None):
    """An imported checkpoint holding the weights a model initialised with SOURCE_SEED has;
    `wrong`: that weight with its rows rolled by one attention head (a converter's layout slip)."""
    model_cfg = load_config(tiny_args(prefix, tokenizer)).model
    source = dataclasses.replace(model_cfg, init_seed=SOURCE_SEED)
    weights = GPTModel(source).state_dict()
    if wrong is not None:
        weights[wrong] = weights[wrong].roll(source.hidden_size // source.num_attention_heads, dims=0)
    path = tmp_path / name
    write_weights_checkpoint(path, source, weights, tp=1, pp=1)
    return path


def _dp2(args: list[str]) -> dict[int, float]:
    return pretrain_gpt.main(args).losses


def test_train_from_imported_weights(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    imported = _import(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model)
    common = tiny_args(
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        "--train-iters",
        "3",
        *QUIET_FLAGS,
        "--bf16",
        "--global-batch-size",
        "8",
    )
    reference = pretrain_gpt.main(common + ["--init-seed", str(SOURCE_SEED)])

    run = tmp_path / "run"
    tuned = common + ["--init-seed", "5", "--load", str(imported), "--save", str(run)]
    first = pretrain_gpt.main(tuned + ["--exit-interval", "2"])
    assert first.resumed_from is None and sorted(first.losses) == [1, 2]
    assert [first.losses[i] for i in (1, 2)] == [reference.losses[i] for i in (1, 2)]
    # restarted: --save holds this run's progress, so the imported weights are not reloaded
    again = pretrain_gpt.main(tuned)
    assert again.resumed_from == 2 and again.losses[3] == reference.losses[3]

    # two data-parallel ranks both start from DP rank 0's (the only) file
    ranks = run_ranks(_dp2, 2, common + ["--init-seed", "5", "--load", str(imported)], timeout_s=120)
    for losses in ranks:
        assert losses[1] == pytest.approx(reference.losses[1], rel=1e-3)
        assert losses[3] == pytest.approx(reference.losses[3], abs=STEP3_TOL)
    # the comparisons can fail: another initialisation, or the imported weights with one layer's
    # query / key / value rows one head off, end step 3 more than twice the tolerance away
    # (then a DP = 2 run of them, within the tolerance of its own single-rank run, is outside it)
    other = pretrain_gpt.main(common + ["--init-seed", "5"])
    assert other.losses[1] != pytest.approx(reference.losses[1], rel=1e-3)
    assert abs(other.losses[3] - reference.losses[3]) > 2 * STEP3_TOL
    wrong = _import(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model, "wrong", wrong="layers.0.attention.qkv.weight")
    off = pretrain_gpt.main(common + ["--init-seed", "5", "--load", str(wrong)])
    assert abs(off.losses[3] - reference.losses[3]) > 2 * STEP3_TOL
