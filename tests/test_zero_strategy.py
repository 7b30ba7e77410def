"""Strategy parsing, the nested shard layout, the byte formulas worked by hand, and parameter
units under module_granularity_threshold (no ranks needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megazpp.config.checks import validate_config
from megazpp.config.load import load_config
from megazpp.errors import ConfigError
from megazpp.zero import memory, sequences, traffic
from megazpp.zero.layout import BucketLayout, dp_pieces, padded_numel
from megazpp.zero.options import ZeroOptions
from megazpp.zero.strategy import VALID_NAMES, Level, parse_strategy
from megazpp.zero.units import is_fine_grained, parameter_units
from megazpp.zero.zeropp import ZeroPP


def test_fourteen_strategies_aliases_and_rejection():
    assert len(VALID_NAMES) == 14 and len(set(VALID_NAMES)) == 14
    for name in VALID_NAMES:
        s = parse_strategy(name.lower())
        assert s.optimizer_state >= s.params and s.optimizer_state >= s.grads and s.name == name
    assert [parse_strategy(i).name for i in range(4)] == ["NNN", "NNG", "NGG", "GGG"]
    assert parse_strategy("MiCS").name == "III" and parse_strategy("ing").name == "ING"
    with pytest.raises(ConfigError) as err:
        parse_strategy("GNN")
    assert all(n in str(err.value) for n in VALID_NAMES)
    for bad in ("NNX", "NN", 7, "zero4"):
        with pytest.raises(ConfigError):
            parse_strategy(bad)


def test_padding_and_tensors_tile_an_aligned_bucket():
    """ZeRO++ alignment leaves gaps between tensors; gradients are written tensor by tensor, so
    the engine zeroes `padding_ranges` explicitly: with the tensors they must cover the buffer."""
    params = [
        ("w", nn.Parameter(torch.zeros(7, 3))),
        ("b", nn.Parameter(torch.zeros(5))),
        ("v", nn.Parameter(torch.zeros(9, 2))),
    ]
    lay = BucketLayout.build(params, 2, 1, 0, align=8)
    tensors = [(off, off + shape.numel()) for off, shape in zip(lay.offsets, lay.shapes)]
    assert all(off % 8 == 0 for off, _ in tensors)
    assert lay.padding_ranges == [(21, 24), (42, 48), (53, 64)] and lay.padded == 64
    assert sorted(tensors + lay.padding_ranges) == [(0, 21), (21, 24), (24, 42), (42, 48), (48, 53), (53, 64)]


def test_g_shard_nests_inside_i_shard_and_both_partition_the_buffer():
    d, k = 8, 4
    params = [("w", nn.Parameter(torch.zeros(7, 3))), ("b", nn.Parameter(torch.zeros(5)))]
    layouts = [BucketLayout.build(params, d, k, r) for r in range(d)]
    assert layouts[0].padded == 32 and layouts[0].decay_numel == 21
    g_cover, i_cover = [], []
    for r, lay in enumerate(layouts):
        (ilo, ihi), (glo, ghi) = lay.shard_range(Level.I), lay.shard_range(Level.G)
        assert ilo <= glo < ghi <= ihi
        g_cover += range(glo, ghi)
        if r < k:  # the first PaRO group covers the buffer once
            i_cover += range(ilo, ihi)
    assert sorted(g_cover) == list(range(32)) and sorted(i_cover) == list(range(32))
    # DP rank 6 = position 2 of PaRO group 1 owns G-piece 2 * 2 + 1 = 5 (elements 20..24),
    # whose decay split straddles the boundary at 21
    assert layouts[6].shard_range(Level.G) == (20, 24)
    assert layouts[6].decay_split(Level.G) == [(0, 1, True), (1, 4, False)]
    # a single-stage collective over all DP ranks names DP rank r's piece: its G shard
    flat = torch.arange(32.0)
    pieces = dp_pieces(flat, k, d // k)
    for r, lay in enumerate(layouts):
        lo, hi = lay.shard_range(Level.G)
        assert torch.equal(pieces[r], flat[lo:hi]) and pieces[r].data_ptr() == flat[lo:hi].data_ptr()


def _two_nodes_of_two() -> sequences.DPShapes:
    return sequences.dp_shapes([0, 1, 2, 3], 2, me=0, ranks_per_node=2)


def test_step_bytes_worked_by_hand_for_ggg_and_nig():
    shapes = _two_nodes_of_two()
    hier = traffic.choose_hierarchy(shapes)
    assert hier == sequences.Hierarchy(True, True, True)
    ggg = parse_strategy("GGG")
    # P = 8 fp32 elements (32 bytes), one micro-batch.
    # fetch x2: cross all-gather of 16 B (8 B from the other node) + intra all-gather of 32 B
    #           (16 B from the node peer) -> (16, 8) each;
    # reduce: intra reduce-scatter of 32 B (16 B) + cross reduce-scatter of 16 B (8 B);
    # norm: all-reduce of 4 B over 4 ranks: 2*4*1//4 = 2 intra, 2*4*2//4 = 4 inter.
    assert traffic.step_bytes(ggg, [8], shapes, hier, micro_batches=1, param_bytes=4, accum_bytes=4) == (
        2 * 16 + 16 + 2,
        2 * 8 + 8 + 4,
    )
    # two groups of 8, the second kept (gathered once, before its first forward, to the step):
    # per micro-batch the first group's forward and backward fetches and both reductions, as
    # above, plus the kept group's one fetch; calls: per micro-batch 2 two-stage fetches (4
    # calls) + 2 reduce sequences (4), the kept fetch (2), the norm
    assert traffic.step_bytes(
        ggg, [8, 8], shapes, hier, micro_batches=2, param_bytes=4, accum_bytes=4, reused=[False, True]
    ) == (2 * (2 * 16 + 2 * 16) + 16 + 2, 2 * (2 * 8 + 2 * 8) + 8 + 4)
    assert traffic.step_calls(ggg, [8, 8], shapes, hier, micro_batches=2, reused=[False, True]) == 2 * (4 + 4) + 2 + 1
    assert traffic.step_calls(ggg, [8, 8], shapes, sequences.Hierarchy(), micro_batches=2) == 2 * (4 + 2) + 1
    # under hpZ over the node pair the backward fetch is one intra-node call (16 B from the peer)
    hpz = sequences.dp_shapes([0, 1, 2, 3], 2, me=0, ranks_per_node=2, hpz=2)
    parts = traffic.step_parts(ggg, [8], hpz, hier, micro_batches=2, param_bytes=4, accum_bytes=4, zeropp=ZeroPP(hpz=2))
    assert list(parts) == list(traffic.STEP_PHASES)
    assert parts["fetch_backward"].bytes_once(hpz) == (16, 0) and parts["fetch_backward"].calls_once(hpz) == 1
    nig = parse_strategy("NIG")
    # per micro-batch: intra reduce-scatter of 32 B -> 16 intra; boundary: cross reduce-scatter
    # of the 16 B I-chunk -> 8 inter; refresh p=N from G: cross + intra all-gather (8 inter, 16
    # intra); norm over all DP ranks. Three micro-batches.
    assert traffic.step_bytes(nig, [8], shapes, hier, micro_batches=3, param_bytes=4, accum_bytes=4) == (
        3 * 16 + 16 + 2,
        8 + 8 + 4,
    )
    flat = sequences.Hierarchy()
    # single-stage all-gather over 4 ranks: 8 B from each peer, 2 peers on the other node
    assert traffic.sequence_bytes(sequences.gather_sequence(Level.G, Level.N, 2, flat), 8, 4, shapes) == (8, 16)


def test_state_bytes_per_level():
    nig = parse_strategy("NIG")
    got = memory.state_bytes(nig, [8, 16], d=4, k=2, param_bytes=2, accum_bytes=4)
    assert got == memory.StateBytes(params=2 * 24, grads=4 * 12, optimizer=12 * 6)
    assert padded_numel(13, 4) == 16 and padded_numel(16, 4) == 16


def test_degenerate_groups_are_never_hierarchical():
    one_node = sequences.dp_shapes([0, 1, 2, 3], 4, me=1, ranks_per_node=4)
    assert traffic.choose_hierarchy(one_node) == sequences.Hierarchy()
    singles = sequences.dp_shapes([0, 1, 2, 3], 1, me=1, ranks_per_node=2)
    assert traffic.choose_hierarchy(singles) == sequences.Hierarchy()


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            nn.Linear(4, 2, bias=False),
            nn.Linear(4, 2, bias=False),
            nn.Linear(2, 4, bias=False),
        )


class _MoE(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.router = nn.Linear(4, n, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(n))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(64, 64)
        self.moe = _MoE(8)


def test_module_granularity_threshold_groups_fine_grained_subtrees():
    block = _Block()
    # threshold 0: one unit per module owning parameters (attn, router, 24 expert linears)
    assert len(parameter_units(block, 0)) == 26
    moe = block.moe  # 32 + 8 * 24 = 224 elements over 1 + 1 + 1 + 8 * 4 = 35 modules -> 6.4
    assert not is_fine_grained(moe, 6) and is_fine_grained(moe, 7)
    units = parameter_units(block, 7)
    assert [u.name for u in units] == ["attn", "moe"]
    assert sum(p.numel() for _, p in units[1].params) == 224
    # the whole block falls under a large threshold: a single unit with every parameter
    assert [u.name for u in parameter_units(block, 10**6)] == ["<root>"]


def test_zero_section_is_the_engine_options_and_refuses_what_it_cannot_honour():
    from megazpp.config.schema import Config

    opts = validate_config(
        Config(
            zero=ZeroOptions(
                stage=3,
                module_granularity_threshold=5000,
                reduce_bucket_size=1234,
                allgather_bucket_size=7,
                stage3_max_live_parameters=0,
                fetch_groups="size",
                hierarchical="never",
                overlap_comm=False,
            )
        ),
        1,
    ).zero
    assert (
        opts.resolved.name,
        opts.module_granularity_threshold,
        opts.reduce_bucket_size,
        opts.allgather_bucket_size,
        opts.stage3_max_live_parameters,
        opts.fetch_groups,
        opts.hierarchical,
        opts.overlap_comm,
        opts.micro_batches_per_step,
    ) == ("GGG", 5000, 1234, 7, 0, "size", "never", False, 1)
    assert ZeroOptions(paro_strategy="nig", paro_group_size=2).resolved.name == "NIG"
    assert ZeroOptions(paro_strategy="ggg", stage=3).resolved.name == "GGG"
    with pytest.raises(ConfigError, match="not implemented yet"):  # refused by the section's own type
        ZeroOptions(stage=3, reduce_scatter=False)
    for bad in (
        {"paro_strategy": "NIG", "stage": 3},
        {"paro_strategy": "GNN"},
        {"stage": 1, "zero_quantized_weights": True},
        {"stage": 2, "zero_hpz_partition_size": 2},
        {"stage": 1, "zero_quantized_gradients": True},
        {"stage": 3, "loco": True},
        {"stage": 2, "stage3_param_persistence_threshold": 100},
    ):
        with pytest.raises(ConfigError):
            ZeroOptions(**bad)


def test_config_validate_refuses_bad_zero_values_before_any_process_group():
    """The `zero` section refuses every bad value when built, before torch.distributed is
    initialised, naming the key; as flags they are refused by the loader."""
    for flags, key in (
        (["--paro-strategy", "GNN"], "zero.paro_strategy"),
        (["--paro-strategy", "NIG", "--zero-stage", "3"], "zero.paro_strategy"),
        (["--zero-stage", "3", "--loco-err-beta", "1.5"], "zero.loco_err_beta"),
        (["--zero-stage", "3", "--fetch-groups", "module"], "zero.fetch_groups"),
        (["--zero-stage", "3", "--hierarchical", "on"], "zero.hierarchical"),
        (["--zero-stage", "3", "--stage3-max-reuse-distance", "-1"], "zero.stage3_max_reuse_distance"),
        (
            ["--zero-stage", "2", "--stage3-param-persistence-threshold", "100"],
            "command line: zero.stage3_param_persistence_threshold = 100: strategy NGG keeps every parameter",
        ),
        (
            ["--zero-stage", "3", "--stage3-param-persistence-threshold", "-1"],
            "zero.stage3_param_persistence_threshold",
        ),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(flags)
    validate_config(load_config(["--paro-strategy", "auto"]), 1)  # the planner decides later


class _Stack(nn.Module):
    """embedding, two repeated blocks, a head: the shape of a transformer for fetch groups."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10, bias=False)


def test_fetch_groups_by_layer_or_by_size():
    from megazpp.zero.units import fetch_groups

    model = _Stack()
    units = parameter_units(model, 0)  # embed, 2 x 26 block units, norm, head
    assert len(units) == 55
    by_layer = fetch_groups(model, units, "layer", 10**9)
    # one group per block (its MoE experts, a nested ModuleList, stay inside it); the norm and
    # the head, consecutive and outside any block, share one
    assert [len(g.modules) for g in by_layer] == [1, 26, 26, 2]
    assert [g.numel for g in by_layer] == [40, 4384, 4384, 768]
    assert sum(g.numel for g in by_layer) == sum(p.numel() for p in model.parameters())
    # a bound splits a layer (a unit larger than the bound is a group of its own)
    bounded = fetch_groups(model, units, "layer", 4160)
    assert [g.numel for g in bounded] == [40, 4160, 224, 4160, 224, 768]
    # by size: blocks do not matter, only the bound
    assert [g.numel for g in fetch_groups(model, units, "size", 10**9)] == [40 + 2 * 4384 + 768]
    # 4200: embed + attn; the first MoE (router + 24 expert linears of 8); the second attn, its
    # router and one expert linear; the other 23 expert linears, the norm and the head
    assert [g.numel for g in fetch_groups(model, units, "size", 4200)] == [
        40 + 4160,
        224,
        4160 + 32 + 8,
        23 * 8 + 128 + 640,
    ]


def test_persistent_parameters_leave_their_units_for_buckets_of_their_own():
    """stage3_param_persistence_threshold: parameters of fewer elements (here everything but the
    attention weights and the head: embedding, routers, expert linears, biases, the norm) leave
    their units before grouping; a unit left empty loses its hooks; the small ones are bucketed
    last-registered first, within the bound."""
    from megazpp.zero.units import fetch_groups, split_persistent

    model = _Stack()
    units = parameter_units(model, 0)
    kept, whole = split_persistent(units, 100, 10**9)
    small = [p for p in model.parameters() if p.numel() < 100]
    order = [id(p) for p in reversed(small)]
    assert [id(p) for b in whole for _, p in b.params] == order
    assert len(whole) == 1 and whole[0].modules == []
    assert [u.name for u in kept] == ["layers.0.attn", "layers.1.attn", "head"]
    assert [n for u in kept for n, _ in u.params] == ["layers.0.attn.weight", "layers.1.attn.weight", "head.weight"]
    groups = fetch_groups(model, kept, "layer", 10**9)
    assert sum(g.numel for g in groups) + whole[0].numel == sum(p.numel() for p in model.parameters())
    bounded = split_persistent(units, 100, 100)[1]
    assert len(bounded) > 1 and all(b.numel <= 100 for b in bounded)
    assert [id(p) for b in bounded for _, p in b.params] == order
    assert split_persistent(units, 0, 10**9) == (units, [])


def test_kept_groups_are_fetched_once_per_step():
    """A group kept (within the reuse budget) is gathered before its first forward of a step and
    stays to the optimizer step: one fetch per step whatever the micro-batches (and 1F1B's
    forwards ahead of backwards); groups not kept are fetched for every forward and backward."""
    shapes = sequences.dp_shapes([0, 1, 2, 3], 2, 0, 2)
    ggg, hier = parse_strategy("GGG"), sequences.Hierarchy(True, True, True)
    numels, reused = [400, 800, 1200], (False, True, True)
    parts = traffic.step_parts(ggg, numels, shapes, hier, micro_batches=4, param_bytes=4, accum_bytes=4, reused=reused)
    assert (parts["fetch_forward"].numels, parts["fetch_forward"].times) == ((400,), 4)
    assert (parts["fetch_forward_once"].numels, parts["fetch_forward_once"].times) == ((800, 1200), 1)
    assert (parts["fetch_backward"].numels, parts["fetch_backward"].times) == ((400,), 4)
    none_kept = traffic.step_calls(ggg, numels, shapes, hier, micro_batches=4, reused=(False,) * 3)
    all_kept = traffic.step_calls(ggg, numels, shapes, hier, micro_batches=4, reused=(True,) * 3)
    # 3 groups x 2 stages: 4 forward and 4 backward fetches each against one
    assert none_kept - all_kept == 3 * 2 * (8 - 1)
