"""The torch reference quantizers: formats, hand-computed codes, error bounds, LoCo and qgZ.

These pin the semantics the Triton kernels are then required to reproduce bit for bit
(tests/test_kernels_triton.py). Everything runs through `kernels` (the CPU dispatch).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import kernels
from kernels import reference
from kernels.format import TINY_ABSMAX


def _codes4(values: list[int]) -> list[int]:
    """Pack signed int4 values, element 2i in the low nibble, as the layout doc states."""
    return [(values[i] & 0xF) | ((values[i + 1] & 0xF) << 4) for i in range(0, len(values), 2)]


def test_int4_layout_and_round_half_even_by_hand():
    x = torch.tensor([7.0, -7.0, 1.0, -3.5, 2.5, -0.5, 0.5, -7.0, 3.0])
    codes, scales = kernels.quantize(x, 4, 4)
    # Blocks [7,-7,1,-3.5] and [2.5,-0.5,0.5,-7] have absmax 7 (scale 1); the tail block
    # [3,0,0,0] is zero-padded and has scale 3/7.
    assert scales[:2].tolist() == [1.0, 1.0]
    assert scales[2] == torch.tensor(3.0) / torch.tensor(7.0)
    expected = [7, -7, 1, -4] + [2, 0, 0, -7] + [7, 0, 0, 0]
    assert codes.dtype == torch.uint8 and codes.numel() == 6
    assert codes.tolist() == _codes4(expected)
    assert codes.tolist()[:2] == [0x97, 0xC1]
    decoded = kernels.dequantize(codes, scales, 4, 4, numel=9)
    assert decoded.shape == (9,)
    assert decoded[:8].tolist() == [7.0, -7.0, 1.0, -4.0, 2.0, 0.0, 0.0, -7.0]


def test_int8_codes_by_hand_and_tail_padding():
    x = torch.tensor([127.0, -63.5, 0.5, 1.5, -254.0])
    codes, scales = kernels.quantize(x, 8, 4)
    assert codes.dtype == torch.int8 and codes.numel() == 8
    assert codes.tolist() == [127, -64, 0, 2, -127, 0, 0, 0]
    assert scales.tolist() == [1.0, 2.0]
    assert kernels.dequantize(codes, scales, 8, 4, numel=5).tolist() == [127.0, -64.0, 0.0, 2.0, -254.0]


def test_zero_and_tiny_blocks_encode_as_zero():
    x = torch.cat([torch.zeros(8), torch.full((8,), TINY_ABSMAX / 2), torch.ones(8)])
    for bits in (4, 8):
        codes, scales = kernels.quantize(x, bits, 8)
        assert scales.tolist()[:2] == [0.0, 0.0]
        out = kernels.dequantize(codes, scales, bits, 8)
        assert torch.equal(out[:16], torch.zeros(16))
        assert torch.equal(out[16:], torch.ones(8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel,block_size", [(4096, 256), (3001, 256), (5000, 2048), (999, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_analytic_bound(bits, numel, block_size, dtype):
    gen = torch.Generator().manual_seed(numel + bits)
    x = (torch.randn(numel, generator=gen) * torch.logspace(-3, 3, numel)).to(dtype)
    codes, scales = kernels.quantize(x, bits, block_size)
    assert scales.numel() == -(-numel // block_size)
    assert codes.numel() == scales.numel() * block_size * bits // 8
    decoded = kernels.dequantize(codes, scales, bits, block_size, numel=numel)
    err = (x.float() - decoded).abs()
    bound = kernels.quantization_error_bound(scales, bits, block_size, numel)
    assert torch.all(err <= bound), float((err - bound).max())
    # The bound is tight: rounding to the grid really costs close to half a step somewhere.
    assert float((err / bound).max()) > 0.9
    # Quantizing the decoded values again is the identity (codes are a fixed point).
    again, again_scales = kernels.quantize(decoded, bits, block_size)
    assert torch.equal(kernels.dequantize(again, again_scales, bits, block_size, numel=numel), decoded)
    assert kernels.dequantize(codes, scales, bits, block_size, numel, dtype=dtype).dtype == dtype


def test_loco_hand_computed_example():
    """err_beta = 0.5 so every intermediate is exact; see docs/arch/kernels.md for the formula."""
    grad = torch.tensor([7.0, 1.0, 0.0, -2.0])
    err = torch.tensor([0.0, 0.5, 0.0, -0.5])
    codes, scales, new_err = kernels.loco_quantize(grad, err, 0.5, 4)
    # compensated = [7, 1.5, 0, -2.5] -> scale 1, codes [7, 2, 0, -2] (ties to even)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == _codes4([7, 2, 0, -2])
    # new error [0, -0.5, 0, -0.5]; blended 0.5*old + 0.5*new = [0, 0, 0, -0.5]
    assert new_err is err  # updated in place
    assert err.tolist() == [0.0, 0.0, 0.0, -0.5]


def test_loco_beta_zero_is_error_feedback_and_removes_bias():
    """With err_beta = 0 the buffer holds the last error, so transmitted values average to g."""
    block = 64
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(4 * block, generator=gen)
    err = kernels.new_error_buffer(grad.numel(), block)
    steps = 64
    sent = torch.zeros_like(grad)
    for _ in range(steps):
        codes, scales, _ = kernels.loco_quantize(grad, err, 0.0, block)
        sent += kernels.dequantize(codes, scales, 4, block)
    plain = kernels.dequantize(*kernels.quantize(grad, 4, block), 4, block)
    bias_plain = (plain - grad).abs().mean()
    bias_loco = (sent / steps - grad).abs().mean()
    assert bias_loco < bias_plain / 10, (float(bias_loco), float(bias_plain))


def test_loco_accumulates_gradients_far_below_the_block_step():
    """A coordinate 1/5000 of its block's largest value: int4 rounds it to 0 every step, and so
    would an int8 error buffer with a scale per block (the blended increment, 0.2 g, is below
    half of the buffer's step, the largest residual / 127: the code never moves). The fp32
    buffer accumulates it: each step adds (1 - beta)(g - sent) to the buffer, so the sum sent
    falls short of the true sum by the final buffer / (1 - beta), under half a step / (1 - beta)."""
    block, beta, steps = 64, 0.8, 3000
    grad = torch.zeros(block)
    grad[0], grad[1] = 1.0, 2e-4  # grad[0]'s residual keeps the buffer's block max at ~0.02
    grad[2] = 0.6  # rounds with a residual, so the block holds errors of both signs
    err = kernels.new_error_buffer(block, block)
    sent = torch.zeros(block)
    for _ in range(steps):
        codes, scales, _ = kernels.loco_quantize(grad, err, beta, block)
        sent += kernels.dequantize(codes, scales, 4, block)
    assert float(kernels.dequantize(*kernels.quantize(grad, 4, block), 4, block)[1]) == 0.0
    step = 1.0 / 7  # the int4 step of the block
    assert float(sent[1]) >= 2 * step  # int8 codes would have sent nothing
    assert abs(float(sent[1]) - steps * 2e-4) <= step / 2 / (1 - beta), (float(sent[1]), steps * 2e-4)


def test_loco_blend_matches_formula_with_default_beta():
    block, beta = 32, 0.8
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(3 * block + 5, generator=gen)
    err = kernels.new_error_buffer(grad.numel(), block)
    err[: grad.numel()] = torch.randn(grad.numel(), generator=gen) * 0.1
    old_err = err[: grad.numel()].clone()
    codes, scales, _ = kernels.loco_quantize(grad, err, beta, block)
    compensated = grad + old_err
    sent = kernels.dequantize(codes, scales, 4, block, grad.numel())
    assert torch.all((compensated - sent).abs() <= kernels.quantization_error_bound(scales, 4, block, grad.numel()))
    b32, keep = torch.tensor(beta), torch.tensor(1 - beta)
    assert torch.equal(err[: grad.numel()], b32 * old_err + keep * (compensated - sent))
    assert torch.equal(err[grad.numel() :], torch.zeros(err.numel() - grad.numel()))  # the tail block's padding


@pytest.mark.parametrize("bits", [4, 8])
def test_dequant_reduce_equals_sum_of_dequantized_parts(bits):
    block, parts, numel = 128, 3, 5 * 128
    gen = torch.Generator().manual_seed(bits)
    quantized = [kernels.quantize(torch.randn(numel, generator=gen), bits, block) for _ in range(parts)]
    codes = torch.stack([c for c, _ in quantized])
    scales = torch.stack([s for _, s in quantized])
    total = torch.zeros(numel)
    for c, s in quantized:
        total = total + kernels.dequantize(c, s, bits, block)
    assert torch.equal(kernels.dequant_reduce(codes, scales, bits, block), total)
    assert torch.equal(kernels.dequant_reduce(codes, scales, bits, block, numel - 7), total[:-7])
    for out_bits in (4, 8):
        requant = kernels.dequant_reduce_quantize(codes, scales, bits, block, out_bits)
        direct = kernels.quantize(total, out_bits, block)
        assert all(torch.equal(a, b) for a, b in zip(requant, direct))
    err = torch.randn(numel, generator=gen) * 0.01
    err_copy = err.clone()
    fused = kernels.dequant_reduce_loco_quantize(codes, scales, bits, block, err, 0.8)
    direct = kernels.loco_quantize(total, err_copy, 0.8, block)
    assert all(torch.equal(a, b) for a, b in zip(fused, direct))


def _qgz_two_stage(grads: torch.Tensor, nodes: int, block: int) -> torch.Tensor:
    """qgZ as docs/arch/kernels.md describes it, on stacked grads [ranks, numel].

    Returns the concatenation of every dp rank's fp32 shard in rank order, so a wrong chunk
    order shows up as a large error, not just a loose bound.
    """
    ranks, numel = grads.shape
    local = ranks // nodes
    shard = numel // ranks
    shard_blocks, shard_bytes = shard // block, shard // 2
    # Local-index-major shard order: chunk j' holds shards n' * local + j' for n' = 0..nodes-1.
    order = [n * local + j for j in range(local) for n in range(nodes)]
    sent = [kernels.quantize(torch.cat([g[d * shard : (d + 1) * shard] for d in order]), 4, block) for g in grads]
    chunk_blocks, chunk_bytes = nodes * shard_blocks, nodes * shard_bytes
    stage2 = {}  # (node, j) -> re-quantized partial sum held by that rank
    for node in range(nodes):
        members = range(node * local, (node + 1) * local)
        for j in range(local):
            codes = torch.stack([sent[r][0][j * chunk_bytes : (j + 1) * chunk_bytes] for r in members])
            scales = torch.stack([sent[r][1][j * chunk_blocks : (j + 1) * chunk_blocks] for r in members])
            stage2[node, j] = kernels.dequant_reduce_quantize(codes, scales, 4, block, 4)
    shards = []
    for d in range(ranks):
        node, j = divmod(d, local)
        codes = torch.stack([stage2[m, j][0][node * shard_bytes : (node + 1) * shard_bytes] for m in range(nodes)])
        scales = torch.stack([stage2[m, j][1][node * shard_blocks : (node + 1) * shard_blocks] for m in range(nodes)])
        shards.append(kernels.dequant_reduce(codes, scales, 4, block))
    return torch.cat(shards)


def test_qgz_two_int4_stages_within_stated_bound():
    ranks, nodes, block = 4, 2, 64
    numel = ranks * 3 * block
    gen = torch.Generator().manual_seed(11)
    grads = torch.randn(ranks, numel, generator=gen) * torch.logspace(-2, 1, numel)
    reduced = _qgz_two_stage(grads, nodes, block)
    exact = grads.double().sum(dim=0)
    bound = kernels.qgz_error_bound(grads, block).double()
    err = (reduced.double() - exact).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    assert float(err.max()) > 0  # the path really quantized


def test_qgz_bound_is_the_documented_formula():
    grads = torch.tensor([[1.0, -3.0, 0.5, 0.25], [2.0, 0.0, -0.5, 4.0]])
    bound = kernels.qgz_error_bound(grads, 2)
    factor = (1 + 2.0**-10) / 7
    assert torch.allclose(bound, torch.tensor([5.0, 5.0, 4.5, 4.5]) * factor, rtol=1e-6)


def test_bad_input_raises_value_error():
    x = torch.randn(16)
    with pytest.raises(ValueError, match="bits=3"):
        kernels.quantize(x, 3, 8)
    with pytest.raises(ValueError, match="bits=4.0"):
        kernels.quantize(x, 4.0, 8)
    with pytest.raises(ValueError, match="block_size=7"):
        kernels.quantize(x, 4, 7)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        kernels.quantize(x.to(torch.int32), 8, 8)
    codes, scales = kernels.quantize(x, 4, 8)
    with pytest.raises(ValueError, match="int8 codes are stored as torch.int8"):
        kernels.dequantize(codes, scales, 8, 8)
    with pytest.raises(ValueError, match="need 8"):
        kernels.dequantize(codes[:-1], scales, 4, 8)
    with pytest.raises(ValueError, match="numel=17"):
        kernels.dequantize(codes, scales, 4, 8, numel=17)
    err = kernels.new_error_buffer(8, 8)
    with pytest.raises(ValueError, match="expected a contiguous 1-D buffer of 16 values"):
        kernels.loco_quantize(x, err, 0.8, 8)
    with pytest.raises(ValueError, match="must be an fp32 tensor, got torch.int8"):
        kernels.loco_quantize(x, torch.zeros(16, dtype=torch.int8), 0.8, 8)
    with pytest.raises(ValueError, match="on meta but the values"):
        kernels.loco_quantize(x, kernels.new_error_buffer(16, 8, device="meta"), 0.8, 8)
    with pytest.raises(ValueError, match="err_beta"):
        kernels.loco_quantize(x, kernels.new_error_buffer(16, 8), 1.5, 8)
    with pytest.raises(ValueError, match="stacked"):
        kernels.dequant_reduce(codes, scales, 4, 8)
    with pytest.raises(ValueError, match="not meta"):
        kernels.quantize(torch.empty(8, device="meta"), 8, 8)
    with pytest.raises(ValueError, match="output dtype"):
        kernels.dequantize(codes, scales, 4, 8, dtype=torch.int32)


def test_cpu_dispatch_uses_the_reference():
    assert kernels.backend_for(torch.zeros(1)) is reference
    assert kernels.quantize.__wrapped__ is reference.quantize


def test_empty_tensor():
    codes, scales = kernels.quantize(torch.zeros(0), 4, 8)
    assert codes.numel() == 0 and scales.numel() == 0
    assert kernels.dequantize(codes, scales, 4, 8, numel=0).numel() == 0


def test_kernel_ops_protocol_names_the_reference_parameters():
    """`kernels.KernelOps` (the type of `kernel_set`) declares every dispatched op with the
    reference's public parameters, so the type an editor follows is the one that runs."""
    declared = {name for name in vars(kernels.KernelOps) if not name.startswith("_")}
    ops = kernels.kernel_set()
    assert declared == set(vars(ops))
    for name in declared:
        ref = [p for p in inspect.signature(getattr(reference, name)).parameters.values() if p.name != "arith"]
        proto = list(inspect.signature(getattr(kernels.KernelOps, name)).parameters.values())[1:]
        assert [(p.name, p.default) for p in proto] == [(p.name, p.default) for p in ref], name
