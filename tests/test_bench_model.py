"""tools/bench_model.py: megazpp's training step beside Hugging Face's LlamaForCausalLM (same
weights, batch and optimizer) on a tiny CPU shape."""

from __future__ import annotations

import pytest
from support import load_tool

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--vocab-size",
    "128",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--peak-size",
    "128",
    "--peak-repeats",
    "1",
]


def test_hf_peer_runs_the_same_step_beside_megazpp():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[interop])")
    result = load_tool("bench_model").main(TINY + ["--peer", "hf"])
    peer = result["peer"]
    assert peer["tokens_per_s"] > 0 and result["tokens_per_s"] > 0
    # Same weights, same batch, fp32, before any update: the two implementations differ only
    # in rounding (rotate-half vs pairs, fused vs separate projections), O(1e-7) relative on a
    # loss of about log(128) = 4.85; 1e-5 relative bounds it with room.
    assert abs(peer["first_loss"] - result["first_loss"]) <= 1e-5 * result["first_loss"]
    assert 4.0 < result["first_loss"] < 6.0


def test_no_peer_when_asked_and_refusals(capsys):
    bench = load_tool("bench_model")
    assert "peer" not in bench.main(TINY + ["--peer", "none"])
    with pytest.raises(SystemExit):
        bench.main(TINY + ["--peer", "hf", "--arch", "gpt2"])
    assert "--peer hf: needs --arch llama" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main(TINY + ["--device", "cuda"])
        assert "--device cuda: no CUDA device is available" in capsys.readouterr().err
