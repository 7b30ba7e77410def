"""Where every parameter element lives in a bucket's flat buffer, and which slice each rank owns.

Why a nested layout: the flat buffer of P elements (padded to a multiple of the DP size D) is
cut into k I-chunks (PaRO group size k), and each I-chunk into m = D / k G-pieces. The DP rank
at position `local` of PaRO group `group` owns I-chunk `local` and, inside it, G-piece
`group`. So a rank's G shard lies inside its I shard, and the two-stage collectives (reduce-
scatter inside the group, then across the column of equal positions) land exactly on the G
shard with no reshuffle; a single-stage collective over all DP ranks takes its members'
pieces out of order (`dp_pieces`).

Decay parameters come first, so the optimizer shard of a bucket splits into at most two
contiguous pieces (weight decay on, off) that AdamW can take as plain tensors. Padding is
zero, gets zero gradients, and counts as no-decay.

With ZeRO++ quantization (`align` > 1, a multiple of every quantization block) each tensor
starts at a multiple of `align`, so no block ever holds values of two tensors: a block's one
scale is set by its own tensor's largest value, never by a neighbour's (a norm gain's gradient
next to a weight matrix's would otherwise round to zero). The gaps are zero padding like the
tail.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
from torch import nn

from megazpp.optim.optimizer import is_decayed
from megazpp.zero.strategy import Level, level_div


class LayoutRecord(TypedDict):
    """A bucket's layout as a rank file records it (`BucketLayout.describe`), read back by
    `checkpoint.zero_shards` to place the shards of another layout."""

    names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    decay_numel: int
    numel: int
    padded: int
    d: int  # the data-parallel size
    k: int  # the PaRO group size
    dp_index: int


@dataclass
class BucketLayout:
    names: list[str]
    params: list[nn.Parameter]
    shapes: list[torch.Size]  # kept here: a released parameter's own shape is (0,)
    offsets: list[int]
    decay_numel: int
    numel: int
    padded: int
    dp_size: int
    group_size: int
    dp_index: int

    @staticmethod
    def build(
        named_params: list[tuple[str, nn.Parameter]], d: int, k: int, dp_index: int, align: int = 1
    ) -> BucketLayout:
        """`align`: each DP shard and each tensor's offset is a multiple of it (ZeRO++'s
        quantization blocks)."""
        ordered = layout_order(named_params)
        offsets, end = tensor_offsets([p.numel() for _, p in ordered], align)
        decayed = [off + p.numel() for off, (name, p) in zip(offsets, ordered) if is_decayed(name, p)]
        return BucketLayout(
            [n for n, _ in ordered],
            [p for _, p in ordered],
            [p.shape for _, p in ordered],
            offsets,
            max(decayed, default=0),
            end,
            padded_numel(end, d, align),
            d,
            k,
            dp_index,
        )

    @property
    def num_groups(self) -> int:
        return self.dp_size // self.group_size

    def shard_range(self, level: Level) -> tuple[int, int]:
        """[start, end) of this rank's shard at `level` in the flat buffer."""
        size = self.padded // level_div(level, self.dp_size, self.group_size)
        group, local = divmod(self.dp_index, self.group_size)
        if level == Level.N:
            return 0, self.padded
        if level == Level.I:
            return local * size, (local + 1) * size
        index = local * self.num_groups + group
        return index * size, (index + 1) * size

    def shard_size(self, level: Level) -> int:
        return self.padded // level_div(level, self.dp_size, self.group_size)

    def decay_split(self, level: Level) -> list[tuple[int, int, bool]]:
        """Pieces (start, end, decays) of the `level` shard, relative to the shard's start."""
        lo, hi = self.shard_range(level)
        pieces = []
        if lo < self.decay_numel:
            pieces.append((0, min(hi, self.decay_numel) - lo, True))
        if hi > self.decay_numel:
            pieces.append((max(lo, self.decay_numel) - lo, hi - lo, False))
        return pieces

    def ranges_in_shard(self, level: Level, keep: list[bool]) -> list[tuple[int, int, int]]:
        """Parts of the `level` shard covered by the parameters flagged in `keep`: (the
        parameter's index in this layout, start, end), shard-relative."""
        lo, hi = self.shard_range(level)
        out = []
        for i, (off, shape, k) in enumerate(zip(self.offsets, self.shapes, keep)):
            a, b = max(off, lo), min(off + shape.numel(), hi)
            if k and a < b:
                out.append((i, a - lo, b - lo))
        return out

    @functools.cached_property
    def padding_ranges(self) -> list[tuple[int, int]]:
        """Flat [start, end) of every stretch no tensor owns: the gaps ZeRO++'s per-tensor
        alignment leaves between tensors, and the tail. Gradients written tensor by tensor leave
        them untouched, so they must be zeroed explicitly (or they would feed the grad norm and
        the blocks' scales). Computed once: the engine zeroes them every micro-batch."""
        out, pos = [], 0
        for off, shape in zip(self.offsets, self.shapes):
            if off > pos:
                out.append((pos, off))
            pos = off + shape.numel()
        if self.padded > pos:
            out.append((pos, self.padded))
        return out

    def vector_ranges(self) -> list[tuple[int, int]]:
        """Flat [start, end) of every tensor with at most one dimension (norm gains, biases):
        the ones qgZ sends exactly (few values, and an int4 grid of 15 levels is coarse for them)."""
        return [(off, off + shape.numel()) for off, shape in zip(self.offsets, self.shapes) if is_vector(shape)]

    def describe(self) -> LayoutRecord:
        """The layout without tensors, in terms any reader understands (global parameter names,
        shapes, flat offsets): what a checkpoint needs to place its shards without rebuilding
        the model or re-deriving the nested I/G order."""
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "offsets": list(self.offsets),
            "decay_numel": self.decay_numel,
            "numel": self.numel,
            "padded": self.padded,
            "d": self.dp_size,
            "k": self.group_size,
            "dp_index": self.dp_index,
        }

    def flatten(self, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        for off, p in zip(self.offsets, self.params):
            flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    def view_params_into(self, flat: torch.Tensor) -> None:
        """Make every parameter's data a view of `flat` (the gathered or replicated buffer)."""
        for off, p, shape in zip(self.offsets, self.params, self.shapes):
            p.data = flat[off : off + shape.numel()].view(shape)


def is_vector(shape: torch.Size) -> bool:
    """A tensor of at most one dimension (a norm gain, a bias): qgZ sends these exactly."""
    return len(shape) <= 1


def layout_order(named_params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The order parameters take in a bucket: weight-decayed ones first (module docstring)."""
    return [np for np in named_params if is_decayed(*np)] + [np for np in named_params if not is_decayed(*np)]


def dp_piece_order(k: int, m: int) -> list[int]:
    """The G-piece (in buffer order: k I-chunks of m pieces each) of each DP rank: DP rank
    j * k + i (position i of PaRO group j) owns piece i * m + j."""
    return [(r % k) * m + r // k for r in range(k * m)]


def dp_pieces(flat: torch.Tensor, k: int, m: int) -> list[torch.Tensor]:
    """Views of the G-pieces of `flat` by DP rank (`dp_piece_order`). A single-stage collective
    over all DP ranks names these as its members' pieces, so it needs no reordering copy."""
    pieces = flat.view(k * m, -1)
    return [pieces[i] for i in dp_piece_order(k, m)]


def tensor_offsets(numels: Sequence[int], align: int = 1) -> tuple[list[int], int]:
    """Flat offsets of tensors laid out in order, each starting at a multiple of `align`
    (ZeRO++: no quantization block holds values of two tensors), and the end of the last."""
    offsets, pos = [], 0
    for n in numels:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += n
    return offsets, pos


def tensor_layout(tensors: Sequence[tuple[int, bool]], d: int, align: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """A bucket of `tensors` ((numel, is 1-D) in layout order): its padded size and the flat
    ranges of its 1-D tensors (what qgZ sends exactly), as `BucketLayout` lays it out."""
    offsets, end = tensor_offsets([n for n, _ in tensors], align)
    return padded_numel(end, d, align), [(o, o + n) for o, (n, vector) in zip(offsets, tensors) if vector]


def padded_numel(numel: int, d: int, align: int = 1) -> int:
    """Round a bucket up to a multiple of the DP size (times ZeRO++'s block `align`) so every
    level divides it evenly and every quantized chunk is whole blocks."""
    unit = d * align
    return -(-numel // unit) * unit
