"""Two-level training (DiLoCo over islands) on 4 gloo ranks carved into 2 virtual nodes x 2,
so 2 islands of 2 DP ranks each.

One spawn runs every PaRO strategy as the islands' inner engine and checks, per strategy: the
losses against a single-process reference of the two islands (each a LocalEngine fed its
island's share of the batch, the outer Nesterov step taken with the same functions), within
1e-5 as the synchronous engine's own test (fp32, only the reduction order differs); the two
islands bit for bit equal after each sync; the counted bytes and calls of every inner step
equal the engine's formula, and at a sync step the outer exchange (`outer/sync`), the logging
sum and the re-publication equal theirs; the memory held equals the formula; and a save in
the middle of an interval resumed in a fresh model + engine continues bit for bit. Two
strategies also run with bf16 outer gradients (half the outer bytes), two with int4 ones and
error feedback (within 5e-2 of the fp32 reference: 7 levels a side per block of 256 move each
outer step by up to absmax / 14 an element; one resumed bit for bit, error buffers included), three with two streaming
fragments (whole buckets, one synced at every step; the reference syncs the same parameters),
two with those exchanges overlapping one inner step and merged with Streaming DiLoCo's mixing
(one saved with an exchange in flight and resumed bit for bit). Three average AdamW's moments
across islands (the first at every sync of a fragment, the second at every other; fp32, bf16, and
two fragments overlapping one step, resumed bit for bit) against the reference averaging them at
the same syncs, their bytes and calls (`outer/moments`) equal to the formula; after a direct
averaging of every fragment's moments the islands hold the same bits, the mean of theirs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import TINY_LLAMA

from megazpp.launch.local_ranks import run_ranks
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.local_engine import LocalEngine
from megazpp.optim.options import OptimizerOptions, PrecisionOptions
from megazpp.outer import traffic as outer_traffic
from megazpp.outer.diloco import DiLoCoEngine
from megazpp.outer.exchange import average_chunks
from megazpp.outer.fragments import due_fragments
from megazpp.outer.settings import OuterOptions
from megazpp.outer.update import merge, outer_update, warmed_up
from megazpp.parallel import comm
from megazpp.parallel.counter import counter
from megazpp.parallel.topology import Topology
from megazpp.parallel.wire import GroupShape
from megazpp.zero import traffic as zero_traffic
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import VALID_NAMES
from megazpp.zero.zero_engine import ZeroEngine

STEPS, MICRO, H, SAVE_AT, ISLANDS = 5, 2, 2, 3, 2
OPT = OptimizerOptions(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
# each island keeps its inner optimizer's state but where MOMENTS below average it
OUTER = OuterOptions(
    algorithm="diloco", sync_every=H, lr=0.7, momentum=0.9, quantize="none", island_nodes=1, optimizer_state_every=0
)
RESUMED = (
    "NNN",
    "GGG",
    "IIG",
    "GGG/tau1",
    "GGG/int4",
    "GGG/moments-tau1",
    "GGG/warm2",
)  # also saved mid-interval (tau1: an exchange in flight) and resumed
BF16 = ("NNG", "GGG")  # also run with bf16 outer gradients
FRAGMENTED = ("NNG", "GGG", "IIG")  # also run with 2 fragments (one synced at every step)
INT4 = ("NNG", "GGG")  # also with int4 outer gradients and error feedback
OVERLAPPED = ("NNG", "GGG")  # also with 2 fragments whose exchanges overlap one inner step (tau = 1)
WARMED = ("GGG",)  # also with the outer step ramping from plain averaging over 2 syncs (outer.warmup_syncs)
WIRE = {"none": torch.float32, "bf16": torch.bfloat16}
# the runs below average AdamW's state at every sync of a fragment (losses are taken before the
# step, so a later first averaging would reach none of these 5; tests/test_outer_run_sh.py runs
# a period of 2)
STATE_EVERY = 1
MOMENT_EVERY = dict.fromkeys(("exp_avg", "exp_avg_sq"), STATE_EVERY)
# also with the inner moments averaged across islands (MOMENT_EVERY), and these outer settings
MOMENTS = {
    "IIG/moments": {},
    "NNG/moments-bf16": {"quantize": "bf16"},
    "GGG/moments-tau1": {"fragments": 2, "overlap_steps": 1},
}


def _batch(cfg: ModelConfig, dp_rank: int, micro: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _build(
    topo: Topology, island: Topology, strategy: str, outer: OuterOptions = OUTER, bucket: int = 4000
) -> tuple[GPTModel, DiLoCoEngine]:
    model = GPTModel(ModelConfig(**TINY_LLAMA), tp_group=topo.tp_group)
    opts = ZeroOptions(paro_strategy=strategy, micro_batches_per_step=MICRO, reduce_bucket_size=bucket)
    return model, DiLoCoEngine(ZeroEngine(model, OPT, PrecisionOptions(), opts, island), outer, island)


def _steps(model: GPTModel, engine: DiLoCoEngine, topo: Topology, steps: range) -> list[dict]:
    cfg = ModelConfig(**TINY_LLAMA)
    out = []
    for step in steps:
        counter.reset_step()
        total = 0.0
        for micro in range(MICRO):
            inputs, labels = _batch(cfg, topo.dp_rank, micro, step)
            loss = model(inputs, labels).mean() / MICRO
            engine.scale_loss(loss).backward()
            total += loss.item()
        result = engine.step()
        tags = counter.step_totals()["tags"]

        def summed(prefixes: tuple[str, ...], tags: dict = tags) -> tuple[int, int, int]:
            rows = [r for t, r in tags.items() if t.startswith(prefixes)]
            return tuple(sum(r[k] for r in rows) for k in ("intra", "inter", "calls"))

        out.append(
            {
                "loss": total,
                "synced": engine.due(step + 1),
                "scalars": result.scalars,
                "inner": summed(("zero/", "train/grad_norm")),
                "sync": summed(("outer/sync",)),
                "stats": summed(("outer/stats",)),
                "moments": summed(("outer/moments",)),
                "snapshot": engine.snapshot.clone(),
            }
        )
    return out


def _publish_predicted(e: ZeroEngine) -> tuple[int, int, int]:
    """(intra, inter, calls) of re-publishing new masters to level p inside the island
    (`ZeroEngine.publish_masters`) by the traffic formula: the inner step's refresh phases, once."""
    parts = zero_traffic.step_parts(
        e.strategy,
        e.padded_numels(),
        e.shapes,
        e.hier,
        micro_batches=1,
        param_bytes=e.param_dtype.itemsize,
        accum_bytes=e.accum_dtype.itemsize,
        zeropp=e.zeropp,
        reused=e.reused,
        persistent=e.persistent,
    )
    intra = inter = calls = 0
    for part in (parts["refresh"], parts["refresh_persistent"]):
        a, b = part.bytes_once(e.shapes)
        intra, inter, calls = intra + a, inter + b, calls + part.calls_once(e.shapes)
    return intra, inter, calls


def _stats_predicted(island: Topology) -> tuple[int, int]:
    """(intra, inter) of the outer step's logged norms: one all-reduce of two fp32 over the world."""
    world = GroupShape.of(range(island.world_size * island.islands), island.rank, island.ranks_per_node, comm.backend())
    return outer_traffic.stats_bytes(world)


def _moments_as_saved(inner: ZeroEngine) -> bool:
    """The inner optimizer's state the outer loop gets (`moments()`: AdamW's moments of each
    master, in the masters' order) is what the engine's checkpoint saves for each master."""
    state = inner.state_dict()
    slot_of = {tuple(place): slot for slot, place in enumerate(state["optimizer_slots"])}
    places = [(b, j) for b, bucket in enumerate(state["buckets"]) for j in range(len(bucket["masters"]))]
    moments, masters = inner.moments(), inner.masters()
    if len(moments) != len(places) or len(masters) != len(places):
        return False
    for moment, master, place in zip(moments, masters, places):
        saved = state["optimizer"]["state"].get(slot_of.get(place, -1))
        if saved is None or sorted(moment) != ["exp_avg", "exp_avg_sq"]:
            return False  # every master has taken steps by now
        if not all(t.shape == master.shape and torch.equal(t, saved[k]) for k, t in moment.items()):
            return False
    return True


def _sync_number(t: int, sync_every: int, count: int, fragment: int) -> int:
    """Which sync of `fragment` (of `count`) the one due after inner step t is: the steps up to
    t at which it is due, the moments' schedule (`outer.optimizer_state_every`)."""
    return sum(fragment in due_fragments(s, sync_every, count) for s in range(1, t + 1))


def _averaged_moments(engine: DiLoCoEngine, island: Topology) -> dict[str, bool]:
    """Average every fragment's moments now (as a sync does) and compare with the islands'
    moments before: every island holds the same bits after, their mean (fp32: (a + b) / 2 is
    one rounding, so exact; bf16: the mean of the values rounded to bf16, rounded again, so
    within 2^-7 of the larger)."""
    names = list(MOMENT_EVERY)

    def flat() -> dict[str, torch.Tensor]:
        moments = engine.inner.moments()
        return {k: torch.cat([m[k].reshape(-1) for m in moments]) for k in names}

    before = comm.all_gather_object(flat(), group=island.peer_group, tag="test/peers")
    for f in range(len(engine.fragments)):
        engine.average_moments(f, names)
    after = flat()
    peers = comm.all_gather_object(after, group=island.peer_group, tag="test/peers")
    out = {}
    for k in names:
        both = torch.stack([b[k] for b in before])
        bound = 0.0 if engine.options.quantize == "none" else 2.0**-7
        out[f"{k}_equal"] = all(torch.equal(p[k], after[k]) for p in peers)
        out[f"{k}_mean"] = bool(((after[k] - both.mean(dim=0)).abs() <= bound * both.abs().amax(dim=0)).all())
        out[f"{k}_moved"] = not torch.equal(before[0][k], before[-1][k])  # the islands' moments differed
    return out


def _strategies_rank(ckpt_root: str) -> dict:
    from megazpp.checkpoint.load import load_checkpoint
    from megazpp.checkpoint.save import save_checkpoint

    topo = Topology.from_env(ranks_per_node=2)
    island = topo.island_view(1)
    report = {"dp_rank": topo.dp_rank, "island": island.island, "runs": {}}
    for label, name, outer in (
        [(n, n, OUTER) for n in VALID_NAMES]
        + [(f"{n}/bf16", n, dataclasses.replace(OUTER, quantize="bf16")) for n in BF16]
        + [(f"{n}/frag2", n, dataclasses.replace(OUTER, fragments=2)) for n in FRAGMENTED]
        + [(f"{n}/tau1", n, dataclasses.replace(OUTER, fragments=2, overlap_steps=1)) for n in OVERLAPPED]
        + [(f"{n}/int4", n, dataclasses.replace(OUTER, quantize="int4")) for n in INT4]
        + [
            (label, label.split("/")[0], dataclasses.replace(OUTER, optimizer_state_every=STATE_EVERY, **extra))
            for label, extra in MOMENTS.items()
        ]
        + [(f"{n}/warm2", n, dataclasses.replace(OUTER, warmup_syncs=2)) for n in WARMED]
    ):
        model, engine = _build(topo, island, name, outer)
        steps = _steps(model, engine, topo, range(SAVE_AT))
        run = {
            "held": engine.held_bytes(),
            "expected": engine.expected_bytes(),
            "inner_predicted": (*engine.inner.expected_step_bytes(MICRO), engine.inner.expected_step_calls(MICRO)),
            "sync_predicted": engine.expected_sync_bytes(),
            "stats_predicted": _stats_predicted(island),
            "publish_predicted": _publish_predicted(engine.inner),
            "moments_as_saved": _moments_as_saved(engine.inner),
            "fragment_names": engine.fragment_names(),
            "fragment_bytes": [engine.expected_sync_bytes([f]) for f in range(len(engine.fragments))],
            "moment_bytes": [engine.expected_moment_bytes(f) for f in range(len(engine.fragments))],
        }
        if label in RESUMED:
            save_checkpoint(f"{ckpt_root}/{name}", SAVE_AT, {"iteration": SAVE_AT, "engine": engine.state_dict()}, topo)
        steps += _steps(model, engine, topo, range(SAVE_AT, STEPS))
        if label in RESUMED:
            model2, engine2 = _build(topo, island, name, outer)
            engine2.load_state_dict(load_checkpoint(f"{ckpt_root}/{name}", topo).state["engine"])
            again = _steps(model2, engine2, topo, range(SAVE_AT, STEPS))
            run["resumed"] = [s["loss"] for s in again] == [s["loss"] for s in steps[SAVE_AT:]] and all(
                torch.equal(a["snapshot"], b["snapshot"]) for a, b in zip(again, steps[SAVE_AT:])
            )
        peers = comm.all_gather_object(engine.snapshot, group=island.peer_group, tag="test/peers")
        run["islands_equal"] = all(torch.equal(peers[0], p) for p in peers)
        run["errors_nonzero"] = all(bool(t.abs().sum() > 0) for pair in engine.errors for t in pair)
        if label in MOMENTS:
            run["moments_averaged"] = _averaged_moments(engine, island)
        run["steps"] = [{k: v for k, v in s.items() if k != "snapshot"} for s in steps]
        report["runs"][label] = run
    return report


def _reference(
    fragments: list[list[str]],
    quantize: str = "none",
    tau: int = 0,
    sync_every: int = H,
    steps: int = STEPS,
    moments: dict[str, int] | None = None,
    warmup_syncs: int = 0,
) -> dict[int, list[float]]:
    """Per global DP rank, its loss at each of `steps` steps: 2 islands as LocalEngines on their
    share of the batch, each fragment (parameter names) exchanged at its steps (every
    `sync_every`, staggered) and applied `tau` steps later (merged with the islands' own
    progress when tau > 0), with DiLoCoEngine's own functions (the pseudo-gradients and their
    mean rounded to the wire format, as on the wire; the outer lr and momentum of each
    fragment's sync ramped over its first `warmup_syncs`). `moments`: AdamW's state averaged
    over the islands at every k-th sync of a fragment, when it is due (in the moments' wire)."""
    wire = WIRE[quantize]
    cfg = ModelConfig(**TINY_LLAMA)
    models = [GPTModel(cfg) for _ in range(ISLANDS)]
    engines = [LocalEngine(m, OPT, PrecisionOptions()) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    snapshot = {n: p.detach().clone() for n, p in params[0].items()}
    momentum = {n: torch.zeros_like(p) for n, p in snapshot.items()}
    per_island = 4 // ISLANDS
    losses: dict[int, list[float]] = {r: [] for r in range(4)}
    pending: list[tuple[int, int, dict[str, torch.Tensor]]] = []
    syncs = [0] * len(fragments)

    def apply(f: int, pseudos: dict[str, torch.Tensor]) -> None:
        lr, mu = warmed_up(OUTER.lr, OUTER.momentum, syncs[f], warmup_syncs)
        syncs[f] += 1
        for name in fragments[f]:
            mean = average_chunks(pseudos[name].to(wire)).to(wire).float()
            outer_update(snapshot[name], mean, momentum[name], lr, mu)
            for ps in params:
                ps[name].data.copy_(
                    merge(ps[name].detach(), snapshot[name], OUTER.merge_alpha) if tau else snapshot[name]
                )

    for step in range(steps):
        for i, (model, engine) in enumerate(zip(models, engines)):
            for r in range(i * per_island, (i + 1) * per_island):
                mine = 0.0
                for micro in range(MICRO):
                    inputs, labels = _batch(cfg, r, micro, step)
                    loss = model(inputs, labels).mean() / (MICRO * per_island)
                    loss.backward()
                    mine += loss.item() * per_island
                losses[r].append(mine)
            engine.step()
        t = step + 1
        for _, f, pseudos in [p for p in pending if p[0] == t]:
            apply(f, pseudos)
        pending = [p for p in pending if p[0] != t]
        for f in due_fragments(t, sync_every, len(fragments)):
            k = _sync_number(t, sync_every, len(fragments), f)
            for key in [key for key, every in (moments or {}).items() if k % every == 0]:
                mwire = WIRE[outer_traffic.moment_wire(quantize)]
                for name in fragments[f]:
                    held = [e.optimizer.state[ps[name]][key] for e, ps in zip(engines, params)]
                    mean = average_chunks(torch.stack(held).to(mwire)).to(mwire).float()
                    for t_ in held:
                        t_.copy_(mean)
            pseudos = {n: torch.stack([snapshot[n] - ps[n].detach() for ps in params]) for n in fragments[f]}
            if tau:
                pending.append((t + tau, f, pseudos))
            else:
                apply(f, pseudos)
    return losses


def test_diloco_every_strategy_matches_reference_and_formulas(tmp_path):
    ranks = run_ranks(_strategies_rank, 4, str(tmp_path), timeout_s=600)
    whole = ranks[0]["runs"]["NNN"]["fragment_names"]
    references = {
        "none": _reference(whole),
        "bf16": _reference(whole, "bf16"),
        "warm2": _reference(whole, warmup_syncs=2),
    }
    assert references["warm2"] != references["none"]  # the warmup reaches the model
    assert references["bf16"] != references["none"]  # the wire format reaches the model
    for name in FRAGMENTED:  # the buckets (so fragments) differ between p = N and p sharded
        halves = ranks[0]["runs"][f"{name}/frag2"]["fragment_names"]
        assert len(whole) == 1 and len(halves) == 2 and sorted(halves[0] + halves[1]) == sorted(whole[0])
        references[f"{name}/frag2"] = _reference(halves)
        assert references[f"{name}/frag2"] != references["none"]
        if name in OVERLAPPED:
            references[f"{name}/tau1"] = _reference(halves, tau=1)
            assert references[f"{name}/tau1"] != references[f"{name}/frag2"]
    for label, extra in MOMENTS.items():  # against the same outer step with each island's moments kept
        names, quantize = ranks[0]["runs"][label]["fragment_names"], extra.get("quantize", "none")
        references[label] = _reference(names, quantize, extra.get("overlap_steps", 0), moments=MOMENT_EVERY)
        kept = references[quantize if len(names) == 1 else f"{label.split('/')[0]}/tau1"]
        assert references[label] != kept, label
    for rank, report in enumerate(ranks):
        dp_rank = rank  # tp = pp = 1: the global DP rank is the rank
        for name, run in report["runs"].items():
            where = (rank, name)
            losses = [s["loss"] for s in run["steps"]]
            # bf16: a pseudo-gradient differing by fp32 reduction order may round to the next
            # bf16 value (a relative 2^-8 of that element), so the bound is looser
            bound = {"bf16": 1e-3, "int4": 5e-2}.get(name.split("-")[-1].split("/")[-1], 1e-5)
            kind = (
                name
                if name.endswith(("/frag2", "/tau1")) or name in MOMENTS
                else "none"
                if name.endswith("/int4")
                else name.split("/")[1]
                if "/" in name
                else "none"
            )
            if name.endswith("/int4"):  # the int4 wire reaches the model, with its error fed back
                assert losses[-1] != references["none"][dp_rank][-1] and run["errors_nonzero"], where
            tau = 1 if name.endswith("tau1") else 0
            assert run["fragment_names"] == ranks[0]["runs"][name]["fragment_names"], where  # same on every rank
            assert losses == pytest.approx(references[kind][dp_rank], abs=bound), where
            assert run["islands_equal"], where
            assert run["held"] == run["expected"], where
            assert run["moments_as_saved"], where
            if name in MOMENTS:
                done = run["moments_averaged"]
                assert done["exp_avg_sq_moved"], where  # the islands' second moments differed before
                assert all(done[f"{k}_{c}"] for k in MOMENT_EVERY for c in ("equal", "mean")), where
            if name in RESUMED:
                assert run["resumed"], where
            intra, inter, calls = run["inner_predicted"]
            pub = run["publish_predicted"]
            count = len(run["fragment_names"])
            for i, s in enumerate(run["steps"]):
                t = i + 1
                due = due_fragments(t, H, count)
                assert s["synced"] == due, (where, i)
                # the all-to-all when due, the all-gather a step later when overlapping: half each
                # (a save finishes the exchanges in flight: their all-gather moved to the save)
                advanced = tau and t > 1 and not (name in RESUMED and t == SAVE_AT + 1)
                halves_now = list(due) + (due_fragments(t - 1, H, count) if advanced else [])
                if not tau:
                    halves_now += due
                landed = bool(due_fragments(t - tau, H, count)) if t > tau else False
                extra = pub if landed else (0, 0, 0)
                assert s["inner"] == (intra + extra[0], inter + extra[1], calls + extra[2]), (where, i)
                moved = tuple(sum(run["fragment_bytes"][f][k] // 2 for f in halves_now) for k in (0, 1))
                assert s["sync"] == ((*moved, len(halves_now)) if halves_now else (0, 0, 0)), (where, i)
                # each moment due at a fragment's k-th sync: one exchange of its own, blocking
                averaged = [
                    f
                    for f in due
                    for every in (MOMENT_EVERY.values() if name in MOMENTS else ())
                    if _sync_number(t, H, count, f) % every == 0
                ]
                moments = tuple(sum(run["moment_bytes"][f][k] for f in averaged) for k in (0, 1))
                assert s["moments"] == (*moments, 2 * len(averaged)), (where, i)
                assert s["stats"] == ((*run["stats_predicted"], 1) if landed else (0, 0, 0)), (where, i)
                if halves_now:
                    assert s["scalars"]["outer/inter_bytes"] == moved[1] + moments[1], (where, i)
                    assert s["scalars"].get("outer/moments_inter_bytes") == (moments[1] if name in MOMENTS else None)
                if landed:
                    assert s["scalars"]["outer/pseudo_grad_norm"] > 0 and s["scalars"]["outer/island_divergence"] > 0
                    if count == 1:  # the logged outer lr and momentum of this sync (the warmup's ramp)
                        warmup = 2 if name.endswith("/warm2") else 0
                        lr, mu = warmed_up(OUTER.lr, OUTER.momentum, (t - tau) // H - 1, warmup)
                        assert (s["scalars"]["outer/lr"], s["scalars"]["outer/momentum"]) == (lr, mu), (where, i)
