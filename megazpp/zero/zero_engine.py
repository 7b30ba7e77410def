"""ZeroEngine: one data-parallel optimizer engine that runs any PaRO strategy from its triple.

One step, top to bottom:
1. backward: each parameter's gradient is moved, as soon as autograd produced it, into its
   bucket (added into the accumulator when g = N, copied into a staging buffer otherwise);
   when a bucket is complete its reduction to level g starts asynchronously;
2. `step()`: finish the reductions, take every bucket from level g to the full sum at level
   os (`sequences.boundary_sequence`), compute the global gradient norm over the os shards,
   unscale (fp16) and clip, run the optimizer (AdamW or SGD) on the fp32 master pieces, and refresh parameters at
   level p from the updated os shard (`sequences.param_sync_sequence`).
With p sharded, `param_fetch.ParamFetcher` gathers and releases parameter units around each
module's forward and backward. Every collective comes from `sequences`, so the bytes the
comm counter records are the bytes `traffic.step_bytes` predicts. ZeRO++ (qwZ, hpZ, qgZ)
and LoCo swap the gather and micro-batch reduction paths (`zeropp_paths.ZeroPPPaths`); the
engine only tells the paths when buckets are built and steps end.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megazpp.errors import ConfigError
from megazpp.optim.engine_protocol import ScaledOptimizerEngine, StepResult
from megazpp.optim.grad_norm import clip_by_norm_, global_grad_norm
from megazpp.optim.loss_scaler import scaler_for
from megazpp.optim.optimizer import build_optimizer
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.parallel.tensor_parallel import param_is_tp_sharded
from megazpp.parallel.topology import Topology
from megazpp.parallel.work import Done
from megazpp.state import StateDict
from megazpp.zero import accounting, memory, sequences, traffic
from megazpp.zero.bucket import Bucket
from megazpp.zero.collectives import zero_groups
from megazpp.zero.engine_buckets import (
    frozen_groups,
    norm_order,
    trainable_buckets,
    unit_modules,
    unit_parents,
)
from megazpp.zero.engine_state import engine_state_dict, load_engine_state
from megazpp.zero.frozen import execution_keep
from megazpp.zero.options import ZeroOptions, tied_split_refusal
from megazpp.zero.param_fetch import ParamFetcher
from megazpp.zero.paths import CommPaths
from megazpp.zero.shard_map import ShardLayout, ShardMap, shard_map
from megazpp.zero.strategy import Level, Strategy
from megazpp.zero.zeropp import resolve_zeropp
from megazpp.zero.zeropp_paths import ZeroPPPaths


class ZeroEngine(ScaledOptimizerEngine):
    """The optimizer-engine protocol (scale_loss, step, zero_grad, state_dict) over DP ranks."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerOptions,
        precision: PrecisionOptions,
        options: ZeroOptions,
        topology: Topology,
        *,
        counts_in_norm: Callable[[str, nn.Parameter], bool] | None = None,
        tied_embeddings: bool = False,
        tied_weight: nn.Parameter | None = None,
    ) -> None:
        """`model` is built in fp32 (as for LocalEngine); masters are taken from it before the
        parameters are cast to the precision's model dtype. `counts_in_norm(name, param)`
        says whether this rank counts a parameter in the gradient norm (default: TP-sharded
        parameters everywhere, TP-replicated ones on TP rank 0), as for LocalEngine.
        `tied_embeddings`: the model ties its embedding and output weights; `tied_weight`: this
        stage's copy of that weight, if any. The caller says both: the engine knows the model
        only as a module tree."""
        self.model = model
        self.topology = topology
        self._counts_in_norm = counts_in_norm or (lambda name, p: param_is_tp_sharded(p) or topology.tp_rank == 0)
        self.strategy: Strategy = options.resolved  # checked when the options were built
        self.options = options
        self.clip_grad = optimizer.clip_grad
        self.accum_dtype = precision.accum_dtype
        self.param_dtype = precision.model_dtype
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no trainable parameters for the ZeRO engine")
        self.scaler = scaler_for(precision)
        self.zeropp = resolve_zeropp(options.zeropp, topology)
        self.groups, self.shapes = zero_groups(topology, options.paro_group_size, self.zeropp.hpz)
        chosen = options.hierarchy  # the planner's, under hierarchical auto; else the key's mode
        self.hier = traffic.choose_hierarchy(self.shapes, options.hierarchical if chosen is None else chosen)
        self.paths = (
            ZeroPPPaths(
                self.strategy, self.groups, self.hier, self.shapes, self.zeropp, topology.dp_rank % self.zeropp.hpz
            )
            if self.zeropp.enabled
            else CommPaths(self.strategy, self.groups, self.hier)
        )
        self._tied = self._pipeline_tied_weight(tied_embeddings, tied_weight)
        self.step_count = 0
        self._micro_batches = 0
        self._callback_queued = False
        self.buckets = trainable_buckets(
            model,
            options,
            self.groups,
            self.zeropp,
            topology.dp_rank,
            (self.param_dtype, self.accum_dtype),
            self._counts_in_norm,
            self.paths,
        )
        self.fetched = [b for b in self.buckets if not b.persistent]  # the fetch groups (p sharded)
        self.persistent = len(self.buckets) - len(self.fetched)  # the last buckets, kept whole
        self._norm_order = norm_order(model, self.buckets)
        self.frozen = frozen_groups(model, options, self.groups, self.zeropp, topology.dp_rank, self.param_dtype)
        keep = (
            execution_keep(
                self.fetched, self.frozen, model, options.stage3_max_live_parameters, options.stage3_max_reuse_distance
            )
            if self.strategy.params != Level.N
            else {}
        )
        self.reused = tuple(keep[id(b)] for b in self.fetched) if keep else ()
        self.frozen_reused = tuple(keep[id(b)] for b in self.frozen) if keep else ()
        model.to(self.param_dtype)
        groups = [
            {
                "params": [m.param for b in self.buckets for m in b.masters if m.decays],
                "weight_decay": optimizer.weight_decay,
            },
            {"params": [m.param for b in self.buckets for m in b.masters if not m.decays], "weight_decay": 0.0},
        ]
        self.optimizer_options = optimizer
        self.optimizer = build_optimizer([g for g in groups if g["params"]], optimizer)
        self._bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.layout.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.fetcher: ParamFetcher | None = None
        if self.strategy.params != Level.N:
            self.fetcher = ParamFetcher(
                self.fetched + self.frozen,
                self.paths,
                unit_modules(model, self.fetched + self.frozen),
                unit_parents(model, self.fetched + self.frozen),
                self._queue_backward_callback,
                keep,
                options.stage3_prefetch_bucket_size if options.overlap_comm else 0,
            )
            self._hooks.append(model.register_forward_hook(lambda *_: self.fetcher.forward_finished()))

    # -- construction ------------------------------------------------------------------------
    def _pipeline_tied_weight(self, tied_embeddings: bool, weight: nn.Parameter | None) -> nn.Parameter | None:
        """GPT-2's tied embedding when its two copies live on different pipeline stages.

        The pipeline sums the copies' gradients through `grad_for` between the last backward
        and `step()`, which needs this rank's whole accumulated gradient of the weight: only a
        strategy with g = N keeps it, and its bucket's boundary reduction must wait for step().
        """
        if self.topology.pp == 1:
            return None
        refusal = tied_split_refusal(self.strategy) if tied_embeddings else None
        if refusal is not None:  # refused on every stage alike
            raise ConfigError(refusal)
        return weight if weight is not None and weight.requires_grad else None

    def grad_for(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's accumulated, not yet reduced gradient of `param` (a view the pipeline may
        modify in place before `step()`); only for g = N, where it exists whole."""
        if self.strategy.grads != Level.N:
            raise ConfigError(
                f"zero strategy {self.strategy}: gradients are sharded, there is no whole "
                f"accumulated gradient of a parameter to hand out"
            )
        b, i = self._bucket_of[id(param)]
        if b.boundary_pending is not None:
            raise RuntimeError(f"grad_for: bucket {b.name} is already being reduced")
        off, shape = b.layout.offsets[i], b.layout.shapes[i]
        return b.grad_acc[off : off + shape.numel()].view(shape)

    # -- backward ----------------------------------------------------------------------------
    def _queue_backward_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _on_grad(self, p: nn.Parameter) -> None:
        self._queue_backward_callback()
        b, i = self._bucket_of[id(p)]
        off, n = b.layout.offsets[i], b.layout.shapes[i].numel()
        if p.grad is None:
            raise RuntimeError("a gradient hook fired for a parameter without a gradient")
        grad = p.grad.reshape(-1)
        if self.strategy.grads == Level.N:
            b.grad_acc[off : off + n].add_(grad)
        else:  # copy and the 1/D pre-division in one pass; the rest is zeroed when launching
            if b.staging is None:
                b.staging = self._staging(b)
            torch.mul(grad, 1.0 / self.groups.dp_size, out=b.staging[off : off + n])
        p.grad = None
        b.arrived.add(i)
        if len(b.arrived) == b.num_params:
            self._bucket_done(b)

    def _bucket_done(self, b: Bucket) -> None:
        """All of this micro-batch's gradients of `b` are in: start its reduction, free params."""
        b.launched = True
        s = self.strategy
        if s.grads != Level.N:
            self._wait_micro(b)
            if b.staging is None:  # no parameter of the bucket was used in this backward
                b.staging = self._staging(b).zero_()
            else:
                self._zero_unwritten(b)
            b.micro_pending = self.paths.start_grad_reduce(b, b.staging)
            b.sent, b.staging = b.staging, None
            if not self.options.overlap_comm:
                self._wait_micro(b)
        elif self._is_last_micro_batch() and not (self._tied is not None and self._holds(b, self._tied)):
            self._start_boundary(b)
        if self.fetcher is not None and not b.persistent:
            self.fetcher.gradients_done(b)
        self.groups.order.progress()  # a progress point: later stages of earlier reductions start
        for other in self.buckets:  # finished reductions hand their staging back now, not at the
            if other.micro_pending is not None and other.micro_pending.is_completed():  # next use
                self._wait_micro(other)

    def _staging(self, b: Bucket) -> torch.Tensor:
        """A buffer for this micro-batch's gradient of `b`, from the pool (`buffers.BufferPool`),
        after the previous micro-batch's reduction of `b` has handed its own back (one forward and
        backward ago, so waiting here costs nothing)."""
        self._wait_micro(b)
        return self.groups.buffers.take(b.layout.padded, b.param_store)

    def _zero_unwritten(self, b: Bucket) -> None:
        """Zero what no gradient was written into: the padding (between tensors and at the tail),
        and unused parameters' slices."""
        layout, staging = b.layout, b.staging
        if staging is None:
            raise RuntimeError("zeroing the unwritten slices of a bucket that has no staging buffer")
        unwritten = [staging[lo:hi] for lo, hi in layout.padding_ranges]
        unwritten += [
            staging[off : off + shape.numel()]
            for i, (off, shape) in enumerate(zip(layout.offsets, layout.shapes))
            if i not in b.arrived
        ]
        if unwritten:
            torch._foreach_zero_(unwritten)  # one fused call, not one per range

    def _holds(self, b: Bucket, param: nn.Parameter) -> bool:
        return self._bucket_of[id(param)][0] is b

    def _wait_micro(self, b: Bucket) -> None:
        """Finish `b`'s micro-batch reduction: add its result (a view of the staging buffer it
        ran in) to the accumulator, then hand the buffer back."""
        if b.micro_pending is not None:
            b.grad_acc.add_(b.micro_pending.wait())
            b.micro_pending = None
        if b.sent is not None:
            self.groups.buffers.give(b.sent)
            b.sent = None

    def _is_last_micro_batch(self) -> bool:
        n = self.options.micro_batches_per_step
        return n is not None and self._micro_batches + 1 == n

    def _backward_finished(self) -> None:
        """End of one backward pass: launch what unused parameters left pending, in bucket
        order (the same on every rank, so collectives stay matched)."""
        for b in self.buckets:
            if not b.launched:
                self._bucket_done(b)
            b.launched = False
            b.arrived.clear()
        if self.fetcher is not None:
            self.fetcher.backward_finished()
        self._micro_batches += 1
        self._callback_queued = False

    def _start_boundary(self, b: Bucket) -> None:
        if self.strategy.grads == Level.N:
            b.grad_acc.mul_(1.0 / self.groups.dp_size)
        b.boundary_pending = self.paths.start_boundary(b)
        if not self.options.overlap_comm:
            b.boundary_pending = Done(b.boundary_pending.wait())  # kept until step() takes it

    # -- the engine protocol -----------------------------------------------------------------
    def _os_gradients(self) -> list[torch.Tensor]:
        """Finish every bucket's reductions; the fully reduced fp32 gradient of my os shard."""
        grads = []
        for b in self.buckets:
            self._wait_micro(b)
            if b.boundary_pending is None:
                self._start_boundary(b)
            if b.boundary_pending is None:
                raise RuntimeError("a bucket's boundary reduction was started but left nothing to wait for")
            grads.append(b.boundary_pending.wait().float())
            b.boundary_pending = None
        return grads

    def _norm_groups(self) -> list[ProcessGroup | None]:
        """Groups whose ranks' os shards together hold each gradient element exactly once, then
        the tensor / pipeline groups (as `_model_parallel_norm_groups`)."""
        topo = self.topology
        return [
            self.groups.get(n) for n in sequences.norm_groups(self.strategy) if getattr(self.shapes, n).size > 1
        ] + [group for group, size in ((topo.tp_group, topo.tp), (topo.pp_group, topo.pp)) if size > 1]

    def step(self) -> StepResult:
        if self.fetcher is not None:
            self.fetcher.release_all()
        grads = self._os_gradients()
        scale_before = self.loss_scale
        norm, clip = self._update(grads)
        finite = math.isfinite(norm)
        self.zero_grad()
        for g in grads:  # a boundary ending in an all-gather (hierarchical all-reduce) used the pool
            self.groups.buffers.give(g)
        if self.scaler is not None:
            self.scaler.update(overflow=not finite)
        self.paths.after_step(not finite, self.step_count, clip * self.loss_scale / scale_before)
        return StepResult(grad_norm=norm, skipped=not finite, loss_scale=self.loss_scale)

    def _update(self, grads: list[torch.Tensor]) -> tuple[float, float]:
        """Unscale, take the global norm, clip and update from the os-level gradients (skipped
        when the norm is not finite); returns the norm and the clip coefficient applied. The
        views of `grads` made here end with it, so the step can hand their buffers back."""
        if self.scaler is not None:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        counted = [grads[k][lo:hi] for k, lo, hi in self._norm_order]
        if self.paths.take_overflow():  # a non-finite gradient that qgZ never quantized
            counted.append(torch.full((1,), float("nan"), device=grads[0].device))
        norm = float(global_grad_norm(counted, self._norm_groups()))
        if not math.isfinite(norm):
            return norm, 1.0
        pieces = [(m, g[m.start : m.end]) for b, g in zip(self.buckets, grads) for m in b.masters]
        for m, g in pieces:
            m.param.grad = g
        clip = clip_by_norm_([g for _, g in pieces], norm, self.clip_grad)
        self.optimizer.step()
        for b in self.buckets:
            self._refresh_params(b)
        self.step_count += 1
        return norm, clip

    def _refresh_params(self, b: Bucket) -> None:
        new_os = torch.cat([piece.param for piece in b.masters]).to(self.param_dtype)
        synced = self.paths.start_param_sync(b, new_os).wait()
        b.param_store.copy_(synced)
        self.groups.buffers.give(synced)

    def publish_masters(self) -> None:
        """The fp32 masters were replaced outside a step (two-level training's outer step):
        refresh the parameters at level p from them as a step does, and drop path state made
        from the old ones (hpZ's secondary copy is re-filled by the next gather)."""
        for b in self.buckets:
            self._refresh_params(b)
        self.paths.params_replaced()

    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.micro_pending is not None or b.boundary_pending is not None:
                self._wait_micro(b)
                if b.boundary_pending is not None:
                    b.boundary_pending.wait()
                    b.boundary_pending = None
            for m in b.masters:
                m.param.grad = None
        torch._foreach_zero_([b.grad_acc for b in self.buckets])
        self._micro_batches = 0
        if self.fetcher is not None:
            self.fetcher.reset_stats()

    def close(self) -> None:
        """After the last step (collective: every DP rank calls it): wait for every reduction
        and gather still in flight, then remove the engine's hooks from the model
        (`optim.engine_protocol` says why)."""
        for b in self.buckets:
            if b.micro_pending is not None:
                self._wait_micro(b)
            if b.boundary_pending is not None:
                b.boundary_pending.wait()
                b.boundary_pending = None
        if self.fetcher is not None:
            self.fetcher.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every parameter whole inside the block, e.g. to export weights. Collective: every DP
        rank must enter it. With p = N the parameters are always whole."""
        if self.fetcher is None:
            yield
            return
        for b in self.fetched + self.frozen:
            self.fetcher.fetch(b)
        try:
            yield
        finally:
            self.fetcher.release_all()

    # -- what the outer loop reads and writes (`inner_engine.InnerEngine`) ----------------------
    @property
    def device(self) -> torch.device:
        return self.buckets[0].param_store.device

    def masters(self) -> list[torch.Tensor]:
        return [m.param.data for b in self.buckets for m in b.masters]

    @property
    def state_names(self) -> tuple[str, ...]:
        return self.optimizer_options.state_names

    def moments(self) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = []
        for m in (m for b in self.buckets for m in b.masters):
            state = self.optimizer.state.get(m.param, {})
            out.append({k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == m.param.shape})
        return out

    def shard_map(self) -> ShardMap:
        return shard_map(self.buckets, self.strategy.optimizer_state, self.groups)

    def shard_layout(self) -> ShardLayout:
        g = self.groups
        return ShardLayout(
            self.strategy, g.dp_size, g.group_size, self.hier, self.zeropp, [b.layout.describe() for b in self.buckets]
        )

    def expected_shard_bytes(self, fp32_copies: int) -> int:
        g = self.groups
        return memory.outer_state_bytes(self.strategy, self.padded_numels(), g.dp_size, g.group_size, fp32_copies)

    # -- introspection -----------------------------------------------------------------------
    def padded_numels(self) -> list[int]:
        return [b.layout.padded for b in self.buckets]

    def held_bytes(self) -> memory.StateBytes:
        """Model-state bytes this rank holds, counted from the engine's own tensors."""
        return accounting.held_bytes(self)

    def expected_bytes(self) -> memory.StateBytes:
        """The memory formula's model-state bytes for this engine's layout."""
        return accounting.expected_bytes(self)

    def expected_step_bytes(self, micro_batches: int) -> tuple[int, int]:
        """The traffic formula's (intra, inter) bytes of one step."""
        return accounting.expected_step_bytes(self, micro_batches)

    def expected_step_calls(self, micro_batches: int) -> int:
        """The traffic formula's collective calls of one step."""
        return accounting.expected_step_calls(self, micro_batches)

    def stats(self) -> dict[str, int]:
        """Fetch hooks and parameter all-gather calls since the last step (0 when p = N)."""
        if self.fetcher is None:
            return {"fetch_hooks": 0, "param_all_gathers": 0}
        return {"fetch_hooks": self.fetcher.fetch_hook_calls, "param_all_gathers": self.fetcher.all_gather_calls}

    # -- checkpoints (`engine_state`) ----------------------------------------------------------
    def state_dict(self, *, frozen: bool = True) -> StateDict:
        """Without `frozen` the frozen buckets are left out (an adapters-only checkpoint)."""
        return engine_state_dict(self, frozen=frozen)

    def load_state_dict(self, state: StateDict) -> None:
        load_engine_state(self, state)
