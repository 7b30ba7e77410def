"""GPTModel as a training target: an optimizer step lowers the loss, activation checkpointing
changes nothing numerically, pipeline stages chained equal the whole model."""

from __future__ import annotations

import pytest
import torch

from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel

SMALL = dict(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)


def _batch(cfg, seed=0, b=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_adamw_step_lowers_the_loss(arch):
    cfg = ModelConfig(arch=arch, **SMALL)
    model = GPTModel(cfg)
    inputs, labels = _batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model(inputs, labels).mean()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = model(inputs, labels).mean()
    assert after < before - 0.05, (before.item(), after.item())


def _loss_and_grads(cfg, inputs, labels):
    torch.manual_seed(123)  # same dropout masks for both runs
    model = GPTModel(cfg).train()
    loss = model(inputs, labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("llama", dict(num_query_groups=2, num_experts=3, moe_top_k=2, moe_ffn_hidden_size=8)),
        ("gpt2", {}),
    ],
)
def test_activation_checkpointing_gives_identical_loss_and_grads(arch, extra):
    base = dict(arch=arch, hidden_dropout=0.1, attention_dropout=0.1, **SMALL, **extra)
    inputs, labels = _batch(ModelConfig(**base))
    loss, grads = _loss_and_grads(ModelConfig(**base), inputs, labels)
    ckpt_loss, ckpt_grads = _loss_and_grads(ModelConfig(**base, activation_checkpointing=True), inputs, labels)
    assert torch.equal(loss, ckpt_loss)
    assert grads.keys() == ckpt_grads.keys()
    for name in grads:
        torch.testing.assert_close(ckpt_grads[name], grads[name], atol=0, rtol=0, msg=name)
    # dropout was really on: a second run with another seed gives another loss
    torch.manual_seed(999)
    assert not torch.equal(GPTModel(ModelConfig(**base)).train()(inputs, labels).mean().detach(), loss)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pipeline_stages_chained_equal_the_whole_model(arch):
    cfg = ModelConfig(arch=arch, **SMALL)
    inputs, labels = _batch(cfg)
    whole = GPTModel(cfg)
    first = GPTModel(cfg, post_process=False, layer_range=(0, 1))
    middle = GPTModel(cfg, pre_process=False, post_process=False, layer_range=(1, 2))
    last = GPTModel(cfg, pre_process=False, layer_range=(2, 3))
    loss_whole = whole(inputs, labels)
    hidden = middle(first(inputs))
    assert hidden.shape == (4, cfg.seq_length, cfg.hidden_size)
    torch.testing.assert_close(last(hidden, labels), loss_whole, atol=0, rtol=0)

    # every stage parameter equals the whole model's parameter of the same name
    whole_params = dict(whole.named_parameters())
    for stage in (first, middle, last):
        for name, p in stage.named_parameters():
            if name == "output_layer.weight" and cfg.tie_embeddings:
                expected = whole_params["embedding.word_embeddings.weight"]
            else:
                expected = whole_params[name]
            assert torch.equal(p, expected), name


def test_tied_embeddings_share_one_parameter_on_one_stage_and_are_exposed_per_stage():
    cfg = ModelConfig(arch="gpt2", **SMALL)
    whole = GPTModel(cfg)
    assert whole.output_layer.weight is whole.embedding.word_embeddings.weight
    assert whole.tied_embedding_weight() is whole.embedding.word_embeddings.weight
    first = GPTModel(cfg, post_process=False, layer_range=(0, 2))
    last = GPTModel(cfg, pre_process=False, layer_range=(2, 3))
    middle = GPTModel(cfg, pre_process=False, post_process=False, layer_range=(1, 2))
    assert first.tied_embedding_weight() is first.embedding.word_embeddings.weight
    assert last.tied_embedding_weight() is last.output_layer.weight
    assert middle.tied_embedding_weight() is None
    assert torch.equal(first.tied_embedding_weight(), last.tied_embedding_weight())
    assert GPTModel(ModelConfig(arch="llama", **SMALL)).tied_embedding_weight() is None
    # untied llama: head and embedding are distinct, differently initialised
    llama = GPTModel(ModelConfig(arch="llama", **SMALL))
    assert not torch.equal(llama.output_layer.weight, llama.embedding.word_embeddings.weight)
