"""GPTModel against an independent from-scratch computation (fp64, weights copied).

The reference below shares no code with megazpp.model: it decodes the fused qkv weight row by
row per head, maps each query head to its key/value group by index, rotates with complex
numbers, and writes RMSNorm, LayerNorm, SwiGLU, GELU, softmax attention with a causal mask,
top-k routing and cross-entropy out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel

EMB = "embedding.word_embeddings.weight"


def _rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _norm(cfg, sd, name, x):
    if cfg.arch == "llama":
        return _rms_norm(x, sd[f"{name}.weight"], cfg.norm_eps)
    return _layer_norm(x, sd[f"{name}.weight"], sd[f"{name}.bias"], cfg.norm_eps)


def _linear(sd, name, x, bias):
    y = x @ sd[f"{name}.weight"].T
    return y + sd[f"{name}.bias"] if bias else y


def _rope(u, theta):
    """u [s, d]: dims (2i, 2i+1) are one complex number, rotated by pos * theta^(-2i/d)."""
    s, d = u.shape
    z = torch.complex(u[:, 0::2], u[:, 1::2])
    freq = torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freq[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)
    out = torch.empty_like(u)
    out[:, 0::2], out[:, 1::2] = z.real, z.imag
    return out


def _attention(cfg, sd, name, x):
    b, s, _ = x.shape
    d = cfg.hidden_size // cfg.num_attention_heads
    per_group = cfg.num_attention_heads // cfg.num_query_groups
    w = sd[f"{name}.qkv.weight"]
    bias = sd.get(f"{name}.qkv.bias")
    mask = torch.triu(torch.full((s, s), float("-inf"), dtype=torch.float64), diagonal=1)

    def project(row_block):
        rows = slice(row_block * d, (row_block + 1) * d)
        y = x @ w[rows].T
        return y + bias[rows] if bias is not None else y

    heads = []
    for n in range(cfg.num_attention_heads):
        g, j = divmod(n, per_group)
        base = g * (per_group + 2)
        q, k, v = project(base + j), project(base + per_group), project(base + per_group + 1)
        out = torch.empty(b, s, d, dtype=torch.float64)
        for i in range(b):
            qi, ki = q[i], k[i]
            if cfg.arch == "llama":
                qi, ki = _rope(qi, cfg.rope_theta), _rope(ki, cfg.rope_theta)
            scores = qi @ ki.T / math.sqrt(d) + mask
            out[i] = torch.softmax(scores, dim=-1) @ v[i]
        heads.append(out)
    return _linear(sd, f"{name}.out", torch.cat(heads, dim=-1), cfg.arch == "gpt2")


def _swiglu(sd, name, x):
    gate = x @ sd[f"{name}.gate_proj.weight"].T
    return ((gate * torch.sigmoid(gate)) * (x @ sd[f"{name}.up_proj.weight"].T)) @ sd[f"{name}.down_proj.weight"].T


def _gelu_mlp(sd, name, x):
    z = _linear(sd, f"{name}.fc1", x, True)
    z = 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    return _linear(sd, f"{name}.fc2", z, True)


def _moe(cfg, sd, name, x):
    """Token by token: route, mix the chosen experts; also the Switch load-balancing loss."""
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(tokens)
    probs_all = torch.softmax(tokens @ sd[f"{name}.router.weight"].T, dim=-1)
    counts = torch.zeros(cfg.num_experts, dtype=torch.float64)
    for t in range(tokens.shape[0]):
        chosen = torch.argsort(probs_all[t], descending=True)[: cfg.moe_top_k]
        for e in chosen.tolist():
            counts[e] += 1
            out[t] += probs_all[t, e] * _swiglu(sd, f"{name}.experts.{e}", tokens[t : t + 1])[0]
    aux = cfg.num_experts * ((counts / (tokens.shape[0] * cfg.moe_top_k)) * probs_all.mean(0)).sum()
    return out.view_as(x), aux


def reference_forward(cfg, state, ids, labels):
    """(logits [b, s, vocab], per-token loss [b, s]) in fp64."""
    sd = {k: v.detach().double() for k, v in state.items()}
    h = sd[EMB][ids]
    if cfg.arch == "gpt2":
        h = h + sd["embedding.position_embeddings.weight"][: ids.shape[1]]
    aux_total = torch.zeros((), dtype=torch.float64)
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        h = h + _attention(cfg, sd, f"{p}.attention", _norm(cfg, sd, f"{p}.input_norm", h))
        x = _norm(cfg, sd, f"{p}.post_attention_norm", h)
        if cfg.num_experts:
            y, aux = _moe(cfg, sd, f"{p}.mlp", x)
            aux_total = aux_total + aux
        elif cfg.arch == "llama":
            y = _swiglu(sd, f"{p}.mlp", x)
        else:
            y = _gelu_mlp(sd, f"{p}.mlp", x)
        h = h + y
    h = _norm(cfg, sd, "final_norm", h)
    logits = h @ sd[EMB if cfg.tie_embeddings else "output_layer.weight"].T
    loss = torch.logsumexp(logits, -1) - logits.gather(-1, labels[..., None])[..., 0]
    return logits, loss + cfg.moe_aux_loss_coeff * aux_total


def _perturb_norms_and_biases(model: GPTModel) -> None:
    """Norm weights start at 1 and biases at 0, which would hide a missing scale or bias."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.rand(p.shape, generator=g) + (0.5 if "norm" in name and "weight" in name else -0.5))


CASES = {
    "llama_gqa": dict(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=64,
        seq_length=12,
        rope_theta=500.0,
    ),
    "gpt2": dict(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=12),
    "llama_moe": dict(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=1,
        vocab_size=64,
        seq_length=12,
        num_experts=6,
        moe_top_k=2,
        moe_ffn_hidden_size=16,
        moe_aux_loss_coeff=0.1,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_from_scratch_reference(case):
    cfg = ModelConfig(**CASES[case], init_std=0.2)
    torch.manual_seed(0)
    model = GPTModel(cfg).eval()
    _perturb_norms_and_biases(model)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    ref_logits, ref_loss = reference_forward(cfg, model.state_dict(), ids, labels)
    with torch.no_grad():
        logits = model(ids)
        loss = model(ids, labels)
    assert loss.dtype == torch.float32 and loss.shape == (2, cfg.seq_length)
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=0)
    # the loss must depend on the labels, not only on the logits
    assert loss.std() > 1e-3
