"""A guard, run without a GPU, against tensors made without a device on the engines' paths.

On CPU ranks a buffer made by `torch.zeros(n)` lands on the right device by accident, so a CPU
CI cannot see it; on CUDA ranks it is the first outer sync's crash of issue 36 (`padded` in
`DiLoCoEngine._start`). Here the engines run with `torch.device("meta")` as the default device:
a tensor made without a device lands on `meta`, which holds no data, and the first op that
meets a real tensor fails (a copy to or from it, a kernel, a collective, `.item()`). Buffers
made from their data (`new_zeros`, `empty_like`) or with an explicit `device=` are unaffected;
a host-only value says `device="cpu"` on purpose and passes too.

Why this rather than a static (AST) check of `megazpp/`: it tests behaviour, not spelling. An AST
rule sees `torch.zeros(n, device=d)` and cannot tell whether `d` is the data's device or a
stale `"cpu"`; it misses a tensor made device-less inside a helper, another layer (`kernels/`,
the model's rotary cache) or torch itself (`torch.cat` of no pieces), and it flags host values
that are right. The guard follows every layer a step touches: the model's forward, the ZeRO
engine's hooks, the outer step, the quantization kernels, the collectives, a state dict saved,
read back on the host (as `checkpoint_load` does) and loaded. Its limit: only what runs is
checked, so the runs below are the paths issue 36 named: the synchronous engine (ZeRO-2, and
ZeRO-3 with qwZ + hpZ + qgZ + LoCo), and two-level training with int4 outer gradients and
error feedback, streaming fragments with overlap (tau 1 and 2, ranks holding nothing of a
fragment), bf16, and a save with an exchange in flight resumed bit for bit.

Autograd runs hooks outside the default-device mode (its engine does not carry the mode
stack), so every hook registered while a run is built is wrapped to run under the guard too:
the engines' gradient reductions are checked, not skipped.

The negative control runs the code before the fix (`padded` made without a device): it trains
unguarded, as it did on CPU ranks, and fails under the guard on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator

import torch
from support import TINY_LLAMA, zero_keys
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megazpp.config.planner import PlannerSettings
from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer.diloco import DiLoCoEngine
from megazpp.outer.exchange import Exchange, padded_size
from megazpp.outer.settings import OuterOptions
from megazpp.parallel.topology import Topology
from megazpp.planner import auto, probe
from megazpp.zero.options import ZeroOptions
from megazpp.zero.zero_engine import ZeroEngine
from megazpp.zero.zeropp import ZeroPP

STEPS, SAVE_AT, MICRO = 5, 3, 2
OPT = OptimizerOptions(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
OUTER = OuterOptions(
    algorithm="diloco", sync_every=2, lr=0.7, momentum=0.9, quantize="none", island_nodes=1, optimizer_state_every=0
)
# label: (strategy, ZeRO++ switches, outer options or None for the synchronous engine)
RUNS: dict[str, tuple[str, ZeroPP, OuterOptions | None]] = {
    "zero3/qwz+hpz+qgz+loco": ("GGG", ZeroPP(qwz=True, hpz=2, qgz=True, loco=True), None),
    "zero2/int4/frag2/tau1": (
        "NGG",
        ZeroPP(),
        dataclasses.replace(OUTER, quantize="int4", fragments=2, overlap_steps=1),
    ),
    "zero3/bf16/frag3/tau2/moments": (  # the inner moments averaged: their exchanges' buffers too
        "GGG",
        ZeroPP(),
        dataclasses.replace(
            OUTER, quantize="bf16", sync_every=3, fragments=3, overlap_steps=2, optimizer_state_every=1
        ),
    ),
}


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Tensors made without a device land on `meta` (no data: the first real op fails)."""
    with torch.device("meta"):
        yield


def _guarded(hook: Callable) -> Callable:
    @functools.wraps(hook)
    def run(*args: object, **kwargs: object) -> object:
        with guard():
            return hook(*args, **kwargs)

    return run


class _GuardedCallbacks:
    """The autograd engine, its end-of-backward callbacks queued to run under the guard."""

    def __init__(self, engine: object) -> None:
        self._engine = engine

    def queue_callback(self, callback: Callable[[], None]) -> None:
        self._engine.queue_callback(_guarded(callback))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


@contextlib.contextmanager
def guarded_autograd_hooks() -> Iterator[None]:
    """Hooks registered inside (parameter and tensor hooks, end-of-backward callbacks) run under
    the guard: autograd calls them outside the mode stack of the code that ran backward."""
    post, tensor_hook = torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.register_hook
    engine = torch.autograd.Variable._execution_engine
    torch.Tensor.register_post_accumulate_grad_hook = lambda self, hook: post(self, _guarded(hook))  # type: ignore[method-assign]
    torch.Tensor.register_hook = lambda self, hook: tensor_hook(self, _guarded(hook))  # type: ignore[method-assign]
    torch.autograd.Variable._execution_engine = _GuardedCallbacks(engine)
    try:
        yield
    finally:
        torch.Tensor.register_post_accumulate_grad_hook = post  # type: ignore[method-assign]
        torch.Tensor.register_hook = tensor_hook  # type: ignore[method-assign]
        torch.autograd.Variable._execution_engine = engine


class DevicelessPadded(DiLoCoEngine):
    """The negative control: `_start` as it was before issue 36's fix, its send buffer made
    without a device (on CPU ranks the host, by accident)."""

    def _start(self, f: int, lands: int, group: object) -> Exchange:
        frag = self.fragments[f]
        padded = torch.zeros(padded_size(frag.numel, self.islands, self.options.quantize, self._int4))
        snapshot = frag.gather(self.snapshot)
        for lo, hi, master in frag.masters(self.inner.masters()):
            torch.sub(snapshot[lo:hi], master, out=padded[lo:hi])
        return Exchange.start(f, lands, padded, frag.numel, self.islands, self.options.quantize, self._wire, group)


def _build(
    topo: Topology, strategy: str, zeropp: ZeroPP, outer: OuterOptions | None, engine_class: type[DiLoCoEngine]
) -> tuple[GPTModel, ZeroEngine | DiLoCoEngine]:
    """The model (built on the host, unguarded, as the trainer builds it on its device) and the
    engine, built under the guard: the synchronous one over the world, or two islands."""
    model = GPTModel(ModelConfig(**TINY_LLAMA), tp_group=topo.tp_group)
    opts = ZeroOptions(
        paro_strategy=strategy, micro_batches_per_step=MICRO, reduce_bucket_size=4000, **zero_keys(zeropp)
    )
    with guard():
        if outer is None:
            return model, ZeroEngine(model, OPT, PrecisionOptions(), opts, topo)
        island = topo.island_view(1)
        return model, engine_class(ZeroEngine(model, OPT, PrecisionOptions(), opts, island), outer, island)


def _steps(model: GPTModel, engine: ZeroEngine | DiLoCoEngine, topo: Topology, steps: range, on: bool) -> list[float]:
    cfg = ModelConfig(**TINY_LLAMA)
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + topo.dp_rank)
        ids = torch.randint(0, cfg.vocab_size, (MICRO, 2, cfg.seq_length + 1), generator=g, device="cpu")
        with guard() if on else contextlib.nullcontext():
            total = 0.0
            for micro in range(MICRO):
                loss = model(ids[micro, :, :-1], ids[micro, :, 1:]).mean() / MICRO
                engine.scale_loss(loss).backward()
                total += loss.item()
            engine.step()
        losses.append(total)
    return losses


def _guarded_rank(out_dir: str) -> dict[str, object]:
    """Every run of RUNS under the guard: trained, saved mid-run (the state read back onto the
    host, as a checkpoint is), resumed in a fresh engine; the losses and the resumed ones."""
    with guarded_autograd_hooks():
        return _guarded_runs(out_dir)


def _guarded_runs(out_dir: str) -> dict[str, object]:
    topo = Topology.from_env(ranks_per_node=2)
    report: dict[str, object] = {}
    for label in RUNS:
        model, engine = _build(topo, *RUNS[label], DiLoCoEngine)
        losses = _steps(model, engine, topo, range(SAVE_AT), on=True)
        path = os.path.join(out_dir, f"{label.replace('/', '_')}_rank{topo.rank}.pt")
        with guard():
            torch.save(engine.state_dict(), path)
        losses += _steps(model, engine, topo, range(SAVE_AT, STEPS), on=True)
        engine.close()
        model2, engine2 = _build(topo, *RUNS[label], DiLoCoEngine)
        with guard():
            engine2.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        resumed = _steps(model2, engine2, topo, range(SAVE_AT, STEPS), on=True)
        engine2.close()
        report[label] = {"losses": losses, "resumed": resumed}
    return report


def test_engines_make_no_tensor_without_a_device(tmp_path):
    ranks = run_ranks(_guarded_rank, 4, str(tmp_path), timeout_s=600)
    for rank, report in enumerate(ranks):
        for label, run in report.items():
            losses = run["losses"]
            assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), (rank, label)
            assert run["resumed"] == losses[SAVE_AT:], (rank, label)  # the state loaded acts, bit for bit


def _control_rank() -> list[str]:
    """The control's run (two syncs of the whole shard, which every rank holds half of),
    unguarded then guarded: "trained", or the error the rank met, for each."""
    topo = Topology.from_env(ranks_per_node=2)
    out = []
    for on in (False, True):
        with guarded_autograd_hooks() if on else contextlib.nullcontext():
            model, engine = _build(topo, "NGG", ZeroPP(), OUTER, DevicelessPadded)
            try:
                _steps(model, engine, topo, range(2 * OUTER.sync_every), on=on)
                out.append("trained")
            except (RuntimeError, NotImplementedError) as err:  # every rank, at the same copy
                out.append(f"{type(err).__name__}: {err}")
            finally:
                engine.close()
    return out


def test_guard_fails_on_the_device_less_buffer_of_issue_36():
    for unguarded, guarded in run_ranks(_control_rank, 4, timeout_s=300):
        assert unguarded == "trained"  # on CPU ranks the buffer is on the host by accident: unseen
        assert "meta" in guarded, guarded  # under the guard the copy into it fails


class MetaCollectives(TorchDispatchMode):
    """Fails a collective given a `meta` tensor: the probes only time their collectives and never
    read the buffers, and a collective whose tensors are all on `meta` meets no real tensor (c10d
    has meta kernels), so the guard alone would let it pass; on NCCL ranks it is the CPU tensor
    NCCL refuses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "c10d":
            for t in pytree.tree_leaves((args, kwargs or {})):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    raise RuntimeError(f"{func}: a tensor on meta (made without a device)")
        return func(*args, **(kwargs or {}))


def _probes(topo: Topology, model: GPTModel) -> list[float]:
    """`paro_strategy: auto`'s probes on this rank under the guard, at small sizes: the links,
    the host model's collectives and AdamW rate, rank 0's values broadcast."""
    with guard(), MetaCollectives():
        device = auto.run_device(model)
        links = auto.measure_links(PlannerSettings(probe=True), topo, device)
        times = probe.probe_collectives(probe.dp_groups(topo), sizes=(1 << 8, 1 << 10), repeats=1, device=device)
        rate = probe.probe_optimizer_rate(1 << 10, 1, device=device)
        return probe.broadcast_values([*links, rate, float(len(times))], device=device)


def _probe_rank() -> list[object]:
    """The probes, then the control (their collectives' buffers made without a device, as
    before issue 36's fix): the values, and the error the control met."""
    topo = Topology.from_env(ranks_per_node=2)
    model = GPTModel(ModelConfig(**TINY_LLAMA), tp_group=topo.tp_group)
    calls, large = probe._calls, probe.LARGE
    probe.LARGE = 1 << 12  # the link probe's bandwidth size: the same code path, a CI-sized tensor
    try:
        values = _probes(topo, model)
        # the device a tensor made without one gets (the host on CPU ranks, `meta` under the guard)
        probe._calls = lambda op, numel, size, group, device: calls(op, numel, size, group, torch.empty(0).device)
        try:
            _probes(topo, model)
            return [values, "probed"]
        except (RuntimeError, NotImplementedError) as err:  # every rank, at the first collective
            return [values, f"{type(err).__name__}: {err}"]
    finally:
        probe._calls, probe.LARGE = calls, large


def test_planner_probes_make_no_tensor_without_a_device():
    """The probes run on the ranks before the engine is built (issue 36: on CPU tensors they
    fail on NCCL ranks); the control, a probe buffer made without a device, fails here."""
    for values, control in run_ranks(_probe_rank, 4, timeout_s=300):
        intra_bw, inter_bw, intra_latency, inter_latency, adam_rate, keys = values
        assert intra_bw > 0 and inter_bw > 0 and adam_rate > 0 and intra_latency >= 0 and inter_latency >= 0
        assert keys == 3 * 4  # every op under the four DPShapes names (hpz is the intra group, timed once)
        assert "meta" in control, control
