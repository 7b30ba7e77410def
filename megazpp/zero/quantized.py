"""The quantized collectives of ZeRO++: qwZ's int8 parameter gather and qgZ's int4 reduction.

Why codes and scales travel as one byte buffer: a block-aligned slice of the codes and the
matching slice of the scales form a quantized tensor of their own (kernels/format.py), so a
chunk for one peer is "its codes, then its scales" and a single all-gather or all-to-all moves
both. Every chunk is whole blocks because the engine pads buckets to `ZeroPP.alignment()`
times the DP size: no size ever takes an unquantized fallback.

Both run their first collective asynchronously and the rest when waited on, like
`collectives.PendingSequence`, so a reduction overlaps the rest of backward.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import kernels
from megazpp.parallel import comm
from megazpp.zero.collectives import PendingSequence, ZeroGroups
from megazpp.zero.formulas import Collective


def pack(codes: torch.Tensor, scales: torch.Tensor, parts: int) -> torch.Tensor:
    """One uint8 buffer of `parts` equal chunks, each: its codes, then its scales' bytes."""
    return torch.cat([codes.view(torch.uint8).view(parts, -1),
                      scales.view(torch.uint8).view(parts, -1)], dim=1).reshape(-1)


def unpack(buf: torch.Tensor, parts: int, code_bytes: int,
           code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: codes [parts, code_bytes] and fp32 scales [parts, blocks]."""
    rows = buf.view(parts, -1)
    codes = rows[:, :code_bytes].contiguous().view(code_dtype)
    return codes, rows[:, code_bytes:].contiguous().view(torch.float32)


class PendingQuantizedGather:
    """qwZ: quantize my parameter shard to int8, gather codes + scales along the strategy's
    exact gather sequence, decode the whole buffer into the model dtype."""

    def __init__(self, seq: list[Collective], shard: torch.Tensor, groups: ZeroGroups, block: int,
                 tag: str, ops: SimpleNamespace = kernels.kernel_set()) -> None:
        codes, scales = ops.quantize(shard, 8, block)
        self._ops, self._block, self._dtype = ops, block, shard.dtype
        self._code_bytes = codes.numel()
        self._blob = codes.numel() + scales.numel() * 4
        self._pending = PendingSequence(seq, pack(codes, scales, 1), groups, tag)

    def wait(self) -> torch.Tensor:
        gathered = self._pending.wait()
        parts = gathered.numel() // self._blob
        codes, scales = unpack(gathered, parts, self._code_bytes, torch.int8)
        return self._ops.dequantize(codes.reshape(-1), scales.reshape(-1), 8, self._block, dtype=self._dtype)


class PendingQuantizedReduce:
    """qgZ: int4 all-to-all per stage, each receiver dequantizing and summing its chunks.

    Stage 1 quantizes the whole bucket (LoCo: `loco_quantize` with the stage-1 error buffer);
    a middle stage re-quantizes its fp32 sum (LoCo: `dequant_reduce_loco_quantize` with the
    stage-2 buffer); the last stage's sum is the result, fp32. A non-finite local gradient is
    never quantized (its codes would be meaningless and a NaN block max decodes to zeros): the
    rank sends zeros, raises `overflow`, and returns NaN so the step's norm turns non-finite
    and every rank skips it.
    """

    def __init__(self, grad: torch.Tensor, stages: list[tuple[Any, int]], block: int, tag: str,
                 loco: list[tuple[torch.Tensor, torch.Tensor]] | None = None, err_beta: float = 0.0,
                 ops: SimpleNamespace = kernels.kernel_set()) -> None:
        self.overflow = not bool(ops.all_finite(grad))
        if self.overflow:
            grad = torch.zeros_like(grad)
        self._stages, self._block, self._tag = list(stages), block, tag
        self._loco, self._beta, self._ops = loco, err_beta, ops
        if loco:
            codes, scales, _, _ = ops.loco_quantize(grad, *loco[0], err_beta, block, bits=4)
        else:
            codes, scales = ops.quantize(grad, 4, block)
        self._stage = 0
        self._result: torch.Tensor | None = None
        self._launch(codes, scales)

    def _launch(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        group, size = self._stages[self._stage]
        self._code_bytes = codes.numel() // size
        send = pack(codes, scales, size)
        self._recv = torch.empty_like(send)
        self._work = comm.all_to_all_single(self._recv, send, group=group, async_op=True, tag=self._tag)

    def wait(self) -> torch.Tensor:
        while self._result is None:
            self._work.wait()
            _, size = self._stages[self._stage]
            codes, scales = unpack(self._recv, size, self._code_bytes, torch.uint8)
            self._stage += 1
            if self._stage == len(self._stages):
                self._result = self._ops.dequant_reduce(codes, scales, 4, self._block)
            elif self._loco:
                q, s, _, _ = self._ops.dequant_reduce_loco_quantize(codes, scales, 4, self._block,
                                                                    *self._loco[self._stage], self._beta)
                self._launch(q, s)
            else:
                self._launch(*self._ops.dequant_reduce_quantize(codes, scales, 4, self._block))
        if self.overflow:
            self._result.fill_(float("nan"))
        return self._result
