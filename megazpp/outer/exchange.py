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
from typing import Any

import torch
from torch.distributed import ProcessGroup

from megazpp.outer import traffic
from megazpp.parallel import comm

SYNC_TAG = "outer/sync"


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
    work: Any = None

    @classmethod
    def start(cls, fragment: int, lands: int, pseudo: torch.Tensor, islands: int, quantize: str,
              wire: torch.dtype, group: ProcessGroup | None) -> "Exchange":
        n = traffic.padded_numel(pseudo.numel(), islands, quantize)
        send = torch.zeros(n, dtype=wire)
        send[:pseudo.numel()] = pseudo
        received = torch.empty(islands, n // islands, dtype=wire)
        work = comm.all_to_all_single(received, send.view(islands, n // islands), group=group, async_op=True,
                                      tag=SYNC_TAG)
        return cls(fragment, lands, pseudo, 1, torch.empty(n, dtype=wire), received, work)

    def advance(self, group: ProcessGroup | None) -> None:
        """Stage 1 -> 2: wait for the chunks, average them, issue the all-gather."""
        if self.stage != 1:
            return
        self.work.wait()
        mine = average_chunks(self.received).to(self.full.dtype)
        self.work = comm.all_gather_into_tensor(self.full, mine, group=group, async_op=True, tag=SYNC_TAG)
        self.received, self.stage = None, 2

    def mean(self, group: ProcessGroup | None) -> torch.Tensor:
        """The islands' mean pseudo-gradient (fp32, the same bits on every island), waiting for
        whatever is still in flight."""
        self.advance(group)
        if self.stage == 2:
            self.work.wait()
            self.work, self.stage = None, 3
        return self.full[:self.pseudo.numel()].float()

    def state_dict(self, group: ProcessGroup | None) -> dict[str, Any]:
        """Finished first (every rank saves at the same step), so the state is tensors only."""
        self.mean(group)
        return {"fragment": self.fragment, "lands": self.lands, "pseudo": self.pseudo.clone(), "full": self.full.clone()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Exchange":
        return cls(int(state["fragment"]), int(state["lands"]), state["pseudo"].clone(), 3, state["full"].clone())
