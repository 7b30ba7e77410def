"""Measure what each collective really puts on the inter-node link, next to what `comm`
counts for it: `python -m megazpp.parallel.wire_check --out FILE [--mib N]`, launched by
torchrun on every node of a netlab (tools/netlab.sh) or of a real cluster.

Why: the counter records what its link model (`megazpp.parallel.wire`) says the backend's
algorithm puts on each link; this tool checks that model per operation and backend against the
kernel's own byte counters of the node's inter-node interface (`/sys/class/net/IFACE/statistics`,
IFACE from `--iface`, default eth0).
Each operation runs between barriers; the local rank 0 of every node reads its interface,
and the global rank 0 writes one JSON: per operation the counted inter-node bytes (world
sum) and the bytes the kernel saw received on the nodes' links (sum over nodes).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from megazpp.parallel import comm
from megazpp.parallel.counter import counter, write_json_atomic


def _rx_bytes(iface: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/rx_bytes") as f:
        return int(f.read())


def _operations(elems: int) -> dict[str, Callable[[], object]]:
    world = dist.get_world_size()
    a = torch.ones(elems)
    shard = torch.ones(elems // world)
    out = torch.empty(elems)
    return {
        "all_reduce": lambda: comm.all_reduce(a, tag="wire/all_reduce"),
        "all_gather": lambda: comm.all_gather_into_tensor(out, shard, tag="wire/all_gather"),
        "reduce_scatter": lambda: comm.reduce_scatter_tensor(shard, a, tag="wire/reduce_scatter"),
        "all_to_all": lambda: comm.all_to_all_single(out, a, tag="wire/all_to_all"),
        "broadcast": lambda: comm.broadcast(a, src=0, tag="wire/broadcast"),
    }


def measure(elems: int, iface: str, repeats: int) -> dict[str, dict[str, int]]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    results = {}
    for name, run in _operations(elems).items():
        comm.barrier(tag="wire/barrier")
        before = _rx_bytes(iface) if local_rank == 0 else 0
        counted_before = counter.run_totals()["inter"]
        comm.barrier(tag="wire/barrier")  # nobody sends before every node has read its counter
        for _ in range(repeats):
            run()
        comm.barrier(tag="wire/barrier")
        after = _rx_bytes(iface) if local_rank == 0 else 0
        counted = torch.tensor([counter.run_totals()["inter"] - counted_before, after - before], dtype=torch.float64)
        comm.all_reduce(counted, tag="wire/bookkeeping")  # after both snapshots: not measured
        results[name] = {"counted_inter_bytes": int(counted[0]), "kernel_rx_bytes": int(counted[1])}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file written by global rank 0")
    parser.add_argument("--mib", type=float, default=8.0, help="fp32 MiB per operation's full tensor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iface", default="eth0", help="the node's inter-node interface")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    comm.set_ranks_per_node(int(os.environ["LOCAL_WORLD_SIZE"]))
    world = dist.get_world_size()
    elems = int(args.mib * 2**20 / 4) // world * world
    results = measure(elems, args.iface, args.repeats)
    if dist.get_rank() == 0:
        write_json_atomic(
            args.out,
            {
                "backend": dist.get_backend(),
                "world_size": world,
                "ranks_per_node": int(os.environ["LOCAL_WORLD_SIZE"]),
                "bytes_per_full_tensor": elems * 4,
                "repeats": args.repeats,
                "operations": results,
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
