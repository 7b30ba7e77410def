"""Spawn several gloo ranks on this machine and collect what each returns.

Tests and benchmarks need real multi-rank worlds without torchrun. Ranks rendezvous through a
FileStore in a fresh temporary directory (no port races between concurrent test runs), each
rank runs with one intra-op thread so 4 ranks fit on a 2-core machine, and a rank's exception
is re-raised in the parent with the rank named, instead of leaving the others hanging.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from megazpp.parallel import comm

T = TypeVar("T")


def release_process_groups(*, finished: bool = False) -> None:
    """Destroy the process groups while the interpreter is still whole.

    Why: each gloo group runs worker threads, and the last reference to a collective's tensors
    can be dropped on one of them, which then takes the GIL. Once the interpreter is shutting
    down, a thread taking the GIL is ended on the spot, inside a C++ destructor, and the C++
    runtime aborts the process ("terminate called without an active exception", SIGABRT):
    under load, a run that trained and saved ended with a failure. A group's destructor joins
    its threads, but `destroy_process_group` only drops torch's own references; the group dies
    when nothing else holds it. So the owners let go first (an engine's `close()` removes the
    hooks through which autograd's C++ side kept engine, model and groups alive), the cyclic
    garbage left is collected here, and then the groups are destroyed, their threads joined.

    `finished`: this rank ended normally, so the ranks first meet at a barrier: none closes its
    connections while a peer is still completing the last collective.
    """
    if not dist.is_initialized():  # released already (by the job, before its launcher)
        return
    if finished:
        comm.barrier(tag="shutdown")
    gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def scoped_groups() -> Iterator[None]:
    """Destroy, on the way out, the process groups made inside (the default group stays): a
    test running several jobs in one spawned world, each job building its own Topology (a dozen
    sub-groups, each with gloo threads of its own), would otherwise keep every job's groups and
    threads to the end: thousands of threads per rank over a matrix of jobs. The ranks meet
    at a barrier first, so none destroys a group a peer is still using."""
    before = set(distributed_c10d._world.pg_map)
    try:
        yield
    finally:
        made = [g for g in distributed_c10d._world.pg_map if g not in before]
        comm.barrier(tag="scoped_groups")
        gc.collect()
        for group in made:
            dist.destroy_process_group(group)


def _rank_entry(
    rank: int,
    world_size: int,
    store_path: str,
    out_dir: str,
    timeout_s: float,
    env: dict[str, str],
    fn: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            value = fn(*args, **kwargs)
        finally:
            release_process_groups()
        payload = ("ok", value)
    except BaseException:  # reported to the parent with the rank named, then re-raised there
        payload = ("error", traceback.format_exc())
    with open(result_path, "wb") as f:
        pickle.dump(payload, f)


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: object,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: object,
) -> list[T]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results.

    `fn` must be importable by name (a module-level function), since ranks are spawned.
    `env` is applied in each rank before the process group starts (e.g. LOCAL_WORLD_SIZE).
    """
    with tempfile.TemporaryDirectory(prefix="megazpp_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        ctx = mp.spawn(
            _rank_entry,
            nprocs=world_size,
            join=False,
            args=(world_size, store_path, tmp, timeout_s, dict(env or {}), fn, args, kwargs),
        )
        while not ctx.join(timeout=None):  # join() returns at each rank's exit; wait for all
            pass
        results = []
        errors = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank} exited without a result (exit code {ctx.processes[rank].exitcode})")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
