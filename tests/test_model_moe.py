"""The MoE block: shapes, the load-balancing loss in the loss and in backward, expert grads,
and one module per expert (what the ZeRO module-granularity threshold counts)."""

from __future__ import annotations

import torch

from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.model.mlp import SwiGLUMLP

MOE = dict(
    arch="llama",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    num_experts=8,
    moe_top_k=2,
    moe_ffn_hidden_size=8,
)


def _batch(cfg, b=4):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def test_moe_output_shape_and_expert_modules():
    cfg = ModelConfig(**MOE)
    model = GPTModel(cfg)
    inputs, labels = _batch(cfg)
    assert model(inputs).shape == (4, cfg.seq_length, cfg.vocab_size)
    assert model(inputs, labels).shape == (4, cfg.seq_length)
    mlp = model.layers["0"].mlp
    x = torch.randn(3, 5, cfg.hidden_size)
    out, aux = mlp(x)
    assert out.shape == x.shape and aux.shape == ()
    assert len(mlp.experts) == 8 and all(isinstance(e, SwiGLUMLP) for e in mlp.experts)
    assert all(len(list(e.children())) == 3 for e in mlp.experts)  # gate, up, down


def test_aux_loss_is_positive_added_to_every_token_and_in_backward():
    inputs, labels = _batch(ModelConfig(**MOE))
    runs = {}
    for coeff in (0.0, 0.5):
        model = GPTModel(ModelConfig(**MOE, moe_aux_loss_coeff=coeff))
        loss = model(inputs, labels)
        loss.mean().backward()
        runs[coeff] = (loss.detach(), model.last_moe_aux_loss, model.layers["1"].mlp.router.weight.grad.clone())
    aux = runs[0.5][1]
    # Switch aux is num_experts * sum f_e P_e >= ~1 per layer (1 when perfectly balanced)
    assert aux > 1.5, aux
    torch.testing.assert_close(runs[0.5][0] - runs[0.0][0], torch.full_like(runs[0.0][0], 0.5 * aux.item()))
    # the aux term moves the router gradient by exactly 0.5 * d(aux)/d(router)
    model = GPTModel(ModelConfig(**MOE))
    aux_grad = torch.autograd.grad(_aux_of(model, inputs), model.layers["1"].mlp.router.weight)[0]
    torch.testing.assert_close(runs[0.5][2] - runs[0.0][2], 0.5 * aux_grad, atol=1e-6, rtol=1e-4)
    assert aux_grad.abs().max() > 0


def _aux_of(model, inputs):
    """The summed aux loss of a fresh forward, still attached to the graph."""
    hidden = model.embedding(inputs)
    total = 0.0
    for layer in model.layers.values():
        hidden, aux = layer(hidden)
        total = total + aux
    return total


def test_every_routed_expert_gets_gradients_and_unrouted_ones_get_zeros():
    cfg = ModelConfig(**MOE)
    model = GPTModel(cfg)
    inputs, labels = _batch(cfg, b=8)
    model(inputs, labels).mean().backward()
    for layer in model.layers.values():
        for e, expert in enumerate(layer.mlp.experts):
            for name, p in expert.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, (e, name)

    # force every token to experts 0 and 1: the others get zero (not missing) gradients
    model.zero_grad()
    favour = torch.tensor([50.0, 50.0] + [0.0] * (cfg.num_experts - 2))
    for layer in model.layers.values():
        layer.mlp.router.register_forward_hook(lambda _m, _i, probs: torch.softmax(torch.log(probs) + favour, dim=-1))
    model(inputs, labels).mean().backward()
    for layer in model.layers.values():
        for e, expert in enumerate(layer.mlp.experts):
            for name, p in expert.named_parameters():
                assert p.grad is not None, (e, name)
                assert (p.grad.abs().sum() > 0) == (e < 2), (e, name)
