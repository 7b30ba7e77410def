"""The quantized collectives of ZeRO++: qwZ's int8 parameter gather and qgZ's int4 reduction.

Why codes and scales travel as one byte buffer: a block-aligned slice of the codes and the
matching slice of the scales form a quantized tensor of their own (kernels/format.py), so a
chunk for one peer is "its codes, then its scales" and a single all-gather or all-to-all moves
both. Every chunk is whole blocks because the engine pads buckets to `ZeroPP.alignment()`
times the DP size: no size ever takes an unquantized fallback.

Both run their first collective asynchronously and the later ones as soon as a progress point
sees the earlier done (`collectives.StageOrder`), so a reduction overlaps the rest of backward.

qgZ sends a bucket's 1-D tensors (norm gains, biases) exactly: each peer's chunk carries, after
its scales, the fp32 values of those tensors that fall in it (`ExactPlan`, widths from
`traffic.qgz_exact_widths`), and the receiver overwrites their dequantized sums with the exact
ones. Their int4 codes still travel (the blocks stay uniform) but are never used. qwZ does the
same for parameters (`ExactGather`): each shard's blob carries its 1-D tensors' values in the
model dtype, which overwrite their decoded int8 values, so a norm gain arrives bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

import kernels
from megazpp.parallel import comm
from megazpp.parallel.work import Work
from megazpp.zero.collectives import PendingSequence, StagedWork, ZeroGroups, size_of
from megazpp.zero.layout import dp_piece_order
from megazpp.zero.sequences import Collective
from megazpp.zero.traffic import chunk_ranges, most_per_chunk


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    parts: int,
    exact: torch.Tensor | None = None,
    order: list[int] | None = None,
) -> torch.Tensor:
    """One uint8 buffer of `parts` equal chunks, each: its codes, its scales' bytes, then its
    row of `exact` ([parts, width]; qgZ: fp32, qwZ: the model dtype), if any. `order`: the
    chunk of the input each output chunk takes (default: in order)."""
    rows = [codes.view(torch.uint8).view(parts, -1), scales.view(torch.uint8).view(parts, -1)]
    if exact is not None:
        rows.append(exact.view(torch.uint8).view(parts, -1))
    if order is not None:
        rows = [r[order] for r in rows]
    return torch.cat(rows, dim=1).reshape(-1)


def unpack(
    buf: torch.Tensor,
    parts: int,
    code_bytes: int,
    code_dtype: torch.dtype,
    exact_width: int = 0,
    exact_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack`: codes [parts, code_bytes], fp32 scales [parts, blocks] and the
    exact values [parts, exact_width] of `exact_dtype`."""
    rows = buf.view(parts, -1)
    tail = rows.shape[1] - exact_width * exact_dtype.itemsize
    codes = rows[:, :code_bytes].contiguous().view(code_dtype)
    return (
        codes,
        rows[:, code_bytes:tail].contiguous().view(torch.float32),
        rows[:, tail:].contiguous().view(exact_dtype),
    )


def _positions(pieces: Sequence[tuple[int, int]], offset: int = 0) -> torch.Tensor:
    """The element indices of `pieces`, on the host on purpose (plans are built there, then moved
    to the bucket's device once)."""
    return torch.cat(
        [torch.arange(offset + a, offset + b, device="cpu") for a, b in pieces]
        or [torch.zeros(0, dtype=torch.long, device="cpu")]
    )


@dataclass(frozen=True)
class ExactPlan:
    """Where the exactly sent values of one bucket go in each qgZ stage, for one rank.

    The values travel as a vector in flat-position order: stage 1 sends `first` (positions in
    the bucket); at each stage, value i goes to row `dest[i] // width` of the send matrix
    [parts, width]; after summing the received rows, my first `keep` entries are the vector of
    the next stage; `last` are their positions in the final reduced chunk."""

    first: torch.Tensor
    dests: tuple[torch.Tensor, ...]
    widths: tuple[int, ...]
    keeps: tuple[int, ...]
    last: torch.Tensor

    @staticmethod
    def build(
        ranges: Sequence[tuple[int, int]],
        numel: int,
        stages: Sequence[tuple[int, int]],
        widths: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> ExactPlan | None:
        """`ranges`: flat ranges sent exactly; `stages`: (parts, my chunk index) per stage; the
        index tensors live on `device` (the bucket's), so no reduction copies them there."""
        if not ranges:
            return None
        current, size, dests, keeps = list(ranges), numel, [], []
        for (parts, me), width in zip(stages, widths):
            chunks = chunk_ranges(current, size, parts)
            dests.append(
                torch.cat(
                    [
                        j * width + torch.arange(sum(b - a for a, b in chunk), device="cpu")
                        for j, chunk in enumerate(chunks)
                    ]
                )
            )
            current, size = chunks[me], size // parts
            keeps.append(sum(b - a for a, b in current))
        return ExactPlan(
            _positions(ranges).to(device),
            tuple(d.to(device) for d in dests),
            tuple(widths),
            tuple(keeps),
            _positions(current).to(device),
        )


@dataclass(frozen=True)
class ExactGather:
    """qwZ's exactly sent values of one bucket, for one rank: `mine` are their positions in my
    p-level shard; every shard's blob reserves `width` values for them (`traffic.most_per_chunk`:
    the gather needs equal blobs); after the gather, entry `src[i]` of the [shards, width]
    matrix of received values belongs at position `dst[i]` of the full buffer."""

    mine: torch.Tensor
    width: int
    src: torch.Tensor
    dst: torch.Tensor

    @staticmethod
    def build(
        ranges: Sequence[tuple[int, int]], numel: int, shards: int, me: int, device: torch.device | str = "cpu"
    ) -> ExactGather | None:
        """`ranges`: flat ranges sent exactly; the buffer of `numel` is `shards` equal shards,
        mine the `me`-th."""
        if not ranges:
            return None
        chunks, size = chunk_ranges(ranges, numel, shards), numel // shards
        width = most_per_chunk(ranges, numel, shards)
        src = torch.cat(
            [j * width + torch.arange(sum(b - a for a, b in chunk), device="cpu") for j, chunk in enumerate(chunks)]
        )
        dst = torch.cat([_positions(chunk, j * size) for j, chunk in enumerate(chunks)])
        return ExactGather(_positions(chunks[me]).to(device), width, src.to(device), dst.to(device))


class PendingQuantizedGather(Work[torch.Tensor]):
    """qwZ: quantize my parameter shard to int8, gather codes + scales (+ the `exact` values)
    along the strategy's exact gather sequence, decode the whole buffer into the model dtype."""

    def __init__(
        self,
        seq: list[Collective],
        shard: torch.Tensor,
        groups: ZeroGroups,
        block: int,
        tag: str,
        ops: kernels.KernelOps = kernels.kernel_set(),
        exact: ExactGather | None = None,
    ) -> None:
        codes, scales = ops.quantize(shard, 8, block)
        self._ops, self._block, self._dtype, self._exact = ops, block, shard.dtype, exact
        self._code_bytes = codes.numel()
        values = None
        if exact is not None:
            values = shard.new_zeros(exact.width)
            values[: exact.mine.numel()] = shard[exact.mine]
        send = pack(codes, scales, 1, values)
        self._blob = send.numel()
        self._pending = PendingSequence(seq, send, groups, tag)

    def wait(self) -> torch.Tensor:
        gathered = self._pending.wait()
        parts = gathered.numel() // self._blob
        width = self._exact.width if self._exact is not None else 0
        codes, scales, values = unpack(gathered, parts, self._code_bytes, torch.int8, width, self._dtype)
        full = self._ops.dequantize(codes.reshape(-1), scales.reshape(-1), 8, self._block, dtype=self._dtype)
        if self._exact is not None:
            full[self._exact.dst] = values.reshape(-1)[self._exact.src]
        return full

    def is_completed(self) -> bool:
        return self._pending.is_completed()


class PendingQuantizedReduce(StagedWork):
    """qgZ: int4 all-to-all per stage (`stages`: the groups' names), each receiver
    dequantizing and summing its chunks.

    Stage 1 quantizes the whole bucket (LoCo: `loco_quantize` with the stage-1 error buffer);
    a middle stage re-quantizes its fp32 sum (LoCo: `dequant_reduce_loco_quantize` with the
    stage-2 buffer), as soon as a progress point sees stage 1 done (`collectives.StageOrder`);
    the last stage's sum is the result, fp32. A non-finite local gradient is never quantized
    (its codes would be meaningless and a NaN block max decodes to zeros): the rank sends
    zeros, raises `overflow`, and returns NaN so the step's norm turns non-finite and every
    rank skips it.
    """

    def __init__(
        self,
        grad: torch.Tensor,
        groups: ZeroGroups,
        stages: list[str],
        block: int,
        tag: str,
        loco: list[torch.Tensor] | None = None,
        err_beta: float = 0.0,
        ops: kernels.KernelOps = kernels.kernel_set(),
        exact: ExactPlan | None = None,
    ) -> None:
        super().__init__(groups, stages)
        self.overflow = not bool(ops.all_finite(grad))
        if self.overflow:
            grad = torch.zeros_like(grad)
        self._sizes = [size_of(groups, name) for name in stages]
        # over all DP ranks the buffer's pieces go out in member order (`layout.dp_piece_order`)
        k, m = groups.group_size, groups.num_groups
        self._orders = [dp_piece_order(k, m) if name == "dp" and 1 < k < groups.dp_size else None for name in stages]
        self._block, self._tag = block, tag
        self._loco, self._beta, self._ops = loco, err_beta, ops
        self._exact = exact
        self._values = grad[exact.first].float() if exact is not None else None
        if loco:
            self._codes, self._scales, _ = ops.loco_quantize(grad, loco[0], err_beta, block, bits=4)
        else:
            self._codes, self._scales = ops.quantize(grad, 4, block)
        self._result: torch.Tensor | None = None
        self._begin()

    def _issue(self, j: int, group: ProcessGroup | None) -> Work[object]:
        size = self._sizes[j]
        self._code_bytes = self._codes.numel() // size
        rows = None
        if self._exact is not None:
            values = self._exact_values()
            width = self._exact.widths[j]
            rows = values.new_zeros(size * width)
            rows[self._exact.dests[j]] = values
        send = pack(self._codes, self._scales, size, rows, self._orders[j])
        self._recv = torch.empty_like(send)
        return comm.all_to_all_single(self._recv, send, group=group, async_op=True, tag=self._tag)

    def _complete(self, j: int) -> None:
        width = self._exact.widths[j] if self._exact is not None else 0
        codes, scales, exact = unpack(self._recv, self._sizes[j], self._code_bytes, torch.uint8, width)
        if self._exact is not None:  # summed in sender order, like dequant_reduce
            total = exact[0].clone()
            for row in exact[1:]:
                total += row
            self._values = total[: self._exact.keeps[j]]
        if j + 1 == len(self._sizes):
            self._result = self._ops.dequant_reduce(codes, scales, 4, self._block)
            if self._exact is not None:
                self._result[self._exact.last] = self._exact_values()
        elif self._loco:
            self._codes, self._scales, _ = self._ops.dequant_reduce_loco_quantize(
                codes, scales, 4, self._block, self._loco[j + 1], self._beta
            )
        else:
            self._codes, self._scales = self._ops.dequant_reduce_quantize(codes, scales, 4, self._block)

    def _exact_values(self) -> torch.Tensor:
        if self._values is None:
            raise RuntimeError("the exactly sent values are missing: the reduction has no exact plan")
        return self._values

    def wait(self) -> torch.Tensor:
        self._finish_all()
        if self._result is None:
            raise RuntimeError("the quantized reduction finished without a result")
        if self.overflow:
            self._result.fill_(float("nan"))
        return self._result
