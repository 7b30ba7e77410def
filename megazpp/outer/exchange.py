"""One fragment's averaging over the peer group, in two stages that may span inner steps.

Why apart from the engine: with `outer.overlap_steps` (tau) > 0 a fragment's exchange runs
while inner steps continue (Streaming DiLoCo), so its state (buffers, the pending collective,
which stage it is in) lives across steps and across a checkpoint. Stage 1, an all-to-all of the
pseudo-gradient in the wire format, is issued when the fragment is due; stage 2, the all-gather
of the fp32-averaged chunks, at the next inner step (at once when tau = 0); the result is used
when the fragment lands. Every rank issues the same collectives at the same steps, so the
order over the peer group is one. `megazpp.outer.traffic` counts these two collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from kernels.api import kernel_set
from megazpp.outer import traffic
from megazpp.parallel import comm
from megazpp.parallel.work import Work
from megazpp.state import StateDict

SYNC_TAG = "outer/sync"
WIRE_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "int4": torch.uint8}  # per `outer.quantize`
INT4_BITS = 4
AVERAGE_COLUMNS = 1 << 18  # elements averaged at a time: bounds the fp32 copy of the received chunks
# blocks quantized at a time: bounds the quantize kernel's fp32 temporaries to a few MiB, not the fragment's size
ENCODE_BLOCKS = 4096
NO_BLEND = 0.0  # the LoCo kernel's err_beta: the whole new error is carried (plain error feedback)


class Int4Wire:
    """int4 codes + fp32 scales per block (the qgZ format, `traffic.wire_format`) packed into one
    byte row per chunk, so each stage is one collective; quantized with error feedback: each
    rank's fp32 error buffer of what the wire dropped is added back before the next quantization
    (the project's LoCo kernel, `kernels.api`, with no blending), carried across outer steps.
    With `feedback` off (`outer.error_feedback false`, the ablation) the buffer is cleared before
    each quantization, so the same kernel rounds plainly and nothing is carried.

    The kernels follow the tensors' device, as the inner engine's (`zero.zeropp_paths`): each op
    of `kernels.api.kernel_set` runs the Triton kernel on CUDA tensors and `cpu_kernels` (the
    run's `zero.cpu_quant_kernels`) on CPU ones; the rows are made on the values' device."""

    def __init__(self, block: int, cpu_kernels: str = "reference", feedback: bool = True) -> None:
        self.block = block
        self.ops = kernel_set(cpu_kernels)
        self.feedback = feedback

    def row_bytes(self, chunk: int) -> int:
        return chunk // 2 + chunk // self.block * 4

    def encode(self, values: torch.Tensor, err: torch.Tensor, parts: int) -> torch.Tensor:
        """`values` (whole blocks, `parts` equal chunks) quantized with feedback from `err`
        (updated in place): a [parts, row_bytes] uint8 tensor."""
        if not self.feedback:
            err.zero_()
        chunk = values.numel() // parts
        rows = torch.empty(parts, self.row_bytes(chunk), dtype=torch.uint8, device=values.device)
        step = ENCODE_BLOCKS * self.block
        for p in range(parts):  # a slice of whole blocks at a time: each block quantizes alone, so the same bits
            for lo in range(0, chunk, step):
                hi, at = min(lo + step, chunk), p * chunk
                codes, scales, _ = self.ops.loco_quantize(
                    values[at + lo : at + hi], err[at + lo : at + hi], NO_BLEND, self.block, INT4_BITS
                )
                rows[p, lo // 2 : hi // 2] = codes
                rows[p, chunk // 2 + lo // self.block * 4 : chunk // 2 + hi // self.block * 4] = scales.view(
                    torch.uint8
                )
        return rows

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 values of [parts, row_bytes] rows, one row per chunk: [parts, chunk]."""
        parts, width = rows.shape
        chunk = width * 2 * self.block // (self.block + 8)
        if chunk == 0:  # a rank holding nothing of the fragment: no bytes, no scales to view as fp32
            return torch.zeros(parts, 0, device=rows.device)
        codes = rows[:, : chunk // 2].contiguous()
        scales = rows[:, chunk // 2 :].contiguous().view(torch.float32)
        return torch.stack(
            [self.ops.dequantize(codes[i], scales[i], INT4_BITS, self.block, chunk) for i in range(parts)]
        )


def padded_size(numel: int, islands: int, quantize: str, int4: Int4Wire | None) -> int:
    """The elements of a fragment's send buffer: `numel` padded to equal chunks per island (and
    whole quantization blocks under int4), what `Exchange.start` takes."""
    return traffic.padded_numel(numel, islands, quantize, int4.block if int4 else traffic.DEFAULT_BLOCK)


def average_chunks(received: torch.Tensor) -> torch.Tensor:
    """The mean over islands (dim 0) of the pseudo-gradient chunks one rank received, in fp32."""
    return received.float().mean(dim=0)


@dataclass
class Exchange:
    """A fragment's exchange in flight: `stage` 1 (all-to-all issued), 2 (all-gather issued) or
    3 (done: `full` holds the islands' mean in the wire format)."""

    fragment: int
    lands: int  # the inner step after which the mean is applied
    pseudo: torch.Tensor  # this island's own pseudo-gradient of the fragment (fp32), for logging
    stage: int
    full: torch.Tensor
    received: torch.Tensor | None = None
    sent: torch.Tensor | None = None  # what the all-to-all reads, held until it completes
    work: Work[object] | None = None
    int4: Int4Wire | None = None  # the int4 wire, with error feedback into `errors`
    errors: tuple[torch.Tensor, torch.Tensor] | None = None  # int4: (sent pseudo-gradient, averaged chunk)
    islands: int = 1
    tag: str = SYNC_TAG  # the counter's tag of both collectives

    @classmethod
    def start(
        cls,
        fragment: int,
        lands: int,
        padded: torch.Tensor,
        numel: int,
        islands: int,
        quantize: str,
        wire: torch.dtype,
        group: ProcessGroup | None,
        int4: Int4Wire | None = None,
        errors: tuple[torch.Tensor, torch.Tensor] | None = None,
        tag: str = SYNC_TAG,
    ) -> Exchange:
        """Issue stage 1. `padded` (fp32, `padded_size` elements) holds this island's
        pseudo-gradient of the fragment in its first `numel` elements and zeros after; it is
        kept (as `pseudo`, a view), not copied. Under int4 `wire` is ignored and `errors` (fp32,
        the padded fragment and one chunk) carry each quantization's error to the next sync of
        the fragment. `tag`: what the counter files both collectives under."""
        n = padded.numel()
        pseudo = padded[:numel]
        if int4 is not None and errors is not None:
            send = int4.encode(padded, errors[0], islands)
            full = send.new_empty(send.numel())
        else:
            send = padded.to(wire).view(islands, n // islands)
            full = padded.new_empty(n, dtype=wire)
        received = torch.empty_like(send)
        work = comm.all_to_all_single(received, send, group=group, async_op=True, tag=tag)
        return cls(fragment, lands, pseudo, 1, full, received, send, work, int4, errors, islands, tag)

    def advance(self, group: ProcessGroup | None) -> None:
        """Stage 1 -> 2: wait for the chunks, average them, issue the all-gather."""
        if self.stage != 1:
            return
        self._wait()
        self.sent = None
        received = self.received
        if received is None:
            raise RuntimeError(f"outer exchange of fragment {self.fragment}: stage 1 holds no received chunks")
        if self.int4 is not None and self.errors is not None:
            mine = self.int4.encode(average_chunks(self.int4.decode(received)), self.errors[1], 1).view(-1)
        else:  # a slice of columns at a time: each the same mean over islands, no fp32 copy of them all
            mine = received.new_empty(received.shape[1])
            for lo in range(0, mine.numel(), AVERAGE_COLUMNS):
                mine[lo : lo + AVERAGE_COLUMNS] = average_chunks(received[:, lo : lo + AVERAGE_COLUMNS])
        self.received = None
        self.work = comm.all_gather_into_tensor(self.full, mine, group=group, async_op=True, tag=self.tag)
        self.stage = 2

    def _wait(self) -> None:
        if self.work is None:
            raise RuntimeError(f"outer exchange of fragment {self.fragment}: stage {self.stage} has no work in flight")
        self.work.wait()

    def mean(self, group: ProcessGroup | None) -> torch.Tensor:
        """The islands' mean pseudo-gradient (fp32, the same bits on every island), waiting for
        whatever is still in flight."""
        self.advance(group)
        if self.stage == 2:
            self._wait()
            self.work, self.stage = None, 3
        values = self.full if self.int4 is None else self.int4.decode(self.full.view(self.islands, -1))
        values = values.reshape(-1)
        return values[: self.pseudo.numel()].float()

    def state_dict(self, group: ProcessGroup | None) -> StateDict:
        """Finished first (every rank saves at the same step), so the state is tensors only."""
        self.mean(group)
        return {
            "fragment": self.fragment,
            "lands": self.lands,
            "pseudo": self.pseudo.clone(),
            "full": self.full.clone(),
            "islands": self.islands,
        }

    @classmethod
    def from_state(cls, state: StateDict, device: torch.device, int4: Int4Wire | None = None) -> Exchange:
        """A finished exchange from `state_dict`, its tensors copied onto `device` (the masters')."""
        return cls(
            int(state["fragment"]),
            int(state["lands"]),
            state["pseudo"].to(device, copy=True),
            3,
            state["full"].to(device, copy=True),
            int4=int4,
            islands=int(state["islands"]),
        )
