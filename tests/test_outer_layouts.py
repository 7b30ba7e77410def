"""pretrain_gpt.py with two-level training: TP and PP inside an island reproduce the same job
without them (2 islands of one DP rank each), within 1e-5 in fp32 (only the reduction order
of the TP / PP collectives differs), through the whole entry point (config, island topology,
engine, trainer, outer logging)."""

from __future__ import annotations

import pytest

import pretrain_gpt
from megazpp.launch.local_ranks import run_ranks
from tests.test_training_parallel import common_args

OUTER = ["--outer-algorithm", "diloco", "--outer-sync-every", "2", "--zero-stage", "1"]
LAYOUTS = {  # name: (world, flags)
    "plain": (2, ["--ranks-per-node", "1"]),
    "tp2": (4, ["--ranks-per-node", "2", "--tensor-model-parallel-size", "2"]),
    "pp2": (4, ["--ranks-per-node", "1", "--pipeline-model-parallel-size", "2", "--outer-island-nodes", "2"]),
}


def _job(prefix: str, tokenizer: str, flags: list[str]) -> dict:
    history = pretrain_gpt.main(common_args(prefix, tokenizer) + OUTER + flags)
    return {"losses": history.losses, "val": history.val_losses}


@pytest.mark.slow
def test_tp_and_pp_inside_islands_match_plain_islands(tiny_indexed_prefix, tiny_tokenizer_model):
    args = (str(tiny_indexed_prefix), str(tiny_tokenizer_model))
    results = {name: run_ranks(_job, world, *args, flags, timeout_s=300) for name, (world, flags) in LAYOUTS.items()}
    reference = results["plain"][0]
    assert sorted(reference["losses"]) == [1, 2, 3, 4]
    for name, ranks in results.items():
        compared = 0
        for rank, got in enumerate(ranks):
            if not any(v != v for v in got["losses"].values()):  # NaN: a stage other than the last
                assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5), (name, rank)
                assert got["val"] == pytest.approx(reference["val"], abs=1e-5), (name, rank)
                compared += 1
        assert compared >= 2, name
