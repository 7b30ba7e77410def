"""One object that describes how the world is cut into tensor, data and pipeline parallel
groups, which ranks share a node, and that owns the process groups.

Layout: global rank = tp_rank + tp * (dp_rank + dp * pp_rank). TP varies fastest so a TP group
(the chattiest one: several collectives per layer) stays inside a node; then DP, then PP.
Nodes are blocks of `ranks_per_node` consecutive ranks, taken from the launcher
(`LOCAL_WORLD_SIZE`) or overridden to carve one machine into virtual nodes for tests.

Islands (two-level data parallelism, `megazpp.outer`): the DP ranks may be cut into islands of
consecutive DP indices, each made of whole nodes. `island_view` gives the engine a Topology of
its own island (dp, dp_rank and every DP group are the island's; tp, pp, nodes and ranks stay
global) and the peer group: the rank at my place in every island, which holds my shard.

Group creation is collective: every rank creates every group in the same order (torch
requires it), including groups it is not a member of.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch.distributed as dist
from torch.distributed import ProcessGroup

from megazpp.errors import ConfigError, TopologyError
from megazpp.parallel import comm


def _rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def check_shape(world_size: int, tp: int, pp: int, ranks_per_node: int) -> int:
    """Validate the parallel shape before any group exists; return dp."""
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("ranks_per_node", ranks_per_node),
    ):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp):
        raise TopologyError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size {tp} "
            f"x pipeline_model_parallel_size {pp} = {tp * pp}"
        )
    if world_size % ranks_per_node:
        raise TopologyError(f"world size {world_size} is not divisible by ranks_per_node {ranks_per_node}")
    if ranks_per_node % tp:
        raise TopologyError(
            f"tensor_model_parallel_size {tp} must divide ranks_per_node {ranks_per_node}: "
            f"a tensor-parallel group has to fit inside one node"
        )
    dp = world_size // (tp * pp)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            members = [_rank_of(tp_rank, d, pp_rank, tp, dp) for d in range(dp)]
            per_node = Counter(r // ranks_per_node for r in members)
            if len(set(per_node.values())) > 1:
                raise TopologyError(
                    f"data-parallel group {members} spreads unevenly over nodes of {ranks_per_node} ranks "
                    f"({dict(per_node)} members per node); choose tp/pp/ranks_per_node so that every node "
                    f"holds the same number of members of each data-parallel group"
                )
    return dp


def island_layout(world_size: int, tp: int, pp: int, ranks_per_node: int, island_nodes: int) -> tuple[int, int]:
    """(islands, DP ranks per island) for islands of `island_nodes` nodes, or TopologyError.

    An island is a block of consecutive DP indices holding every tp and pp rank of them, so it
    holds whole model replicas; it must also be exactly `island_nodes` whole nodes (with
    pipeline stages on different nodes, one replica spans several nodes)."""
    dp = check_shape(world_size, tp, pp, ranks_per_node)
    nodes = world_size // ranks_per_node
    if not isinstance(island_nodes, int) or island_nodes < 1 or nodes % island_nodes:
        raise TopologyError(
            f"outer.island_nodes {island_nodes!r} must be a positive divisor of the "
            f"{nodes} node(s) of {ranks_per_node} ranks"
        )
    islands = nodes // island_nodes
    if islands < 2:
        raise TopologyError(
            f"outer.island_nodes {island_nodes} makes one island of all {nodes} node(s): two-level "
            f"training needs at least two islands (use fewer nodes per island, or "
            f"outer.algorithm none)"
        )
    if dp % islands:
        raise TopologyError(f"{islands} islands cannot split the data-parallel size {dp} evenly")
    per = dp // islands
    for i in range(islands):
        ranks = {_rank_of(t, d, p, tp, dp) for t in range(tp) for p in range(pp) for d in range(i * per, (i + 1) * per)}
        held = {r // ranks_per_node for r in ranks}
        if len(held) != island_nodes or len(ranks) != island_nodes * ranks_per_node:
            raise TopologyError(
                f"island {i} (data-parallel ranks {i * per}..{(i + 1) * per - 1} with every tp x pp "
                f"rank) spans nodes {sorted(held)}, not {island_nodes} whole node(s); choose "
                f"outer.island_nodes so that each island holds whole model replicas on whole nodes"
            )
    return islands, per


def dp_groups(world_size: int, tp: int, pp: int, islands: int = 1) -> list[list[int]]:
    """Every data-parallel group's global ranks, in DP order, without a process group (the
    groups `Topology` builds: one per tp rank, pp rank and island), so a rule about them can
    be checked before any rank starts."""
    dp = world_size // (tp * pp)
    per = dp // islands
    return [
        [_rank_of(t, i * per + d, p, tp, dp) for d in range(per)]
        for p in range(pp)
        for t in range(tp)
        for i in range(islands)
    ]


@dataclass
class Topology:
    """The parallel layout of this run, seen from this rank. Build with `from_env`."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    pp_ranks: list[int] = field(default_factory=list)
    dp_intra_ranks: list[int] = field(default_factory=list)
    dp_inter_ranks: list[int] = field(default_factory=list)
    embedding_ranks: list[int] = field(default_factory=list)
    model_parallel_ranks: list[int] = field(default_factory=list)
    tp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    dp_intra_group: ProcessGroup | None = None
    dp_inter_group: ProcessGroup | None = None
    embedding_group: ProcessGroup | None = None
    model_parallel_group: ProcessGroup | None = None
    islands: int = 1  # >1 only in an island view: dp, dp_rank and the DP groups are then one island's
    peer_ranks: list[int] = field(default_factory=list)  # island view: my place in every island
    peer_group: ProcessGroup | None = None
    _subgroups: dict[tuple[str, int, int], tuple[list[int], ProcessGroup | None]] = field(
        default_factory=dict, repr=False
    )

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % (self.dp * self.islands) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp * self.islands)

    @property
    def island(self) -> int:
        """Which island this rank is in (0 without islands)."""
        return (self.rank // self.tp) % (self.dp * self.islands) // self.dp

    def _member(self, tp_rank: int, dp_rank: int, pp_rank: int, island: int | None = None) -> int:
        """Global rank of (tp_rank, dp_rank inside `island`, pp_rank); default my island."""
        island = self.island if island is None else island
        return _rank_of(tp_rank, island * self.dp + dp_rank, pp_rank, self.tp, self.dp * self.islands)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_node

    @classmethod
    def from_env(cls, tp: int = 1, pp: int = 1, ranks_per_node: int | None = None) -> Topology:
        """Read the launcher's world (after `dist.init_process_group`) and create every group.

        Without a process group the world is one rank and every group is None.
        """
        if not dist.is_initialized():
            check_shape(1, tp, pp, 1)
            comm.set_ranks_per_node(1)
            return cls(
                rank=0,
                world_size=1,
                tp=1,
                pp=1,
                dp=1,
                ranks_per_node=1,
                tp_ranks=[0],
                dp_ranks=[0],
                pp_ranks=[0],
                dp_intra_ranks=[0],
                dp_inter_ranks=[0],
                embedding_ranks=[0],
                model_parallel_ranks=[0],
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        from_launcher = ranks_per_node is None
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        dp = check_shape(world, tp, pp, ranks_per_node)
        group_rank = os.environ.get("GROUP_RANK")
        if from_launcher and group_rank is not None and rank // ranks_per_node != int(group_rank):
            raise TopologyError(
                f"rank {rank} runs on node GROUP_RANK={group_rank}, but with "
                f"LOCAL_WORLD_SIZE={ranks_per_node} consecutive ranks per node it would be on "
                f"node {rank // ranks_per_node}; launch the same number of ranks on every node"
            )
        comm.set_ranks_per_node(ranks_per_node)
        topo = cls(rank=rank, world_size=world, tp=tp, pp=pp, dp=dp, ranks_per_node=ranks_per_node)
        topo._create_groups()
        return topo

    def _new_group(self, ranks: list[int], attr: str) -> None:
        """Create one group collectively; keep it if this rank is a member."""
        group = dist.new_group(ranks)
        if self.rank in ranks:
            setattr(self, attr, group)
            setattr(self, attr.replace("_group", "_ranks"), list(ranks))

    def _create_groups(self) -> None:
        tp, dp, pp = self.tp, self.dp, self.pp
        for p in range(pp):
            for d in range(dp):
                self._new_group([_rank_of(t, d, p, tp, dp) for t in range(tp)], "tp_group")
        dp_lists = [[_rank_of(t, d, p, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)]
        for members in dp_lists:
            self._new_group(members, "dp_group")
        for d in range(dp):
            for t in range(tp):
                self._new_group([_rank_of(t, d, p, tp, dp) for p in range(pp)], "pp_group")
        for members in dp_lists:
            by_node: dict[int, list[int]] = {}
            for r in members:
                by_node.setdefault(self.node_of(r), []).append(r)
            for on_node in by_node.values():
                self._new_group(on_node, "dp_intra_group")
            columns = zip(*by_node.values())
            for column in columns:
                self._new_group(list(column), "dp_inter_group")
        for d in range(dp):
            for t in range(tp):
                ends = sorted({_rank_of(t, d, 0, tp, dp), _rank_of(t, d, pp - 1, tp, dp)})
                self._new_group(ends, "embedding_group")
        for d in range(dp):
            self._new_group([_rank_of(t, d, p, tp, dp) for p in range(pp) for t in range(tp)], "model_parallel_group")

    def island_view(self, island_nodes: int) -> Topology:
        """This rank's island as a Topology of its own, for the engine (collective: every rank
        calls it once, in the same order as the other group creations). Its dp, dp_rank and DP
        groups (plus the PaRO sub-groups made from them) are the island's; `peer_ranks` /
        `peer_group` are the ranks at my place in every island (one collective per shard)."""
        if self.islands != 1:
            raise TopologyError("island_view: this topology is already an island's")
        islands, per = island_layout(self.world_size, self.tp, self.pp, self.ranks_per_node, island_nodes)
        view = Topology(
            rank=self.rank,
            world_size=self.world_size // islands,
            tp=self.tp,
            pp=self.pp,
            dp=per,
            ranks_per_node=self.ranks_per_node,
            islands=islands,
            tp_ranks=self.tp_ranks,
            pp_ranks=self.pp_ranks,
            embedding_ranks=self.embedding_ranks,
            model_parallel_ranks=self.model_parallel_ranks,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            embedding_group=self.embedding_group,
            model_parallel_group=self.model_parallel_group,
        )
        for p in range(self.pp):
            for t in range(self.tp):
                for i in range(islands):
                    members = [view._member(t, d, p, i) for d in range(per)]
                    view._new_group(members, "dp_group")
                    by_node: dict[int, list[int]] = {}
                    for r in members:
                        by_node.setdefault(self.node_of(r), []).append(r)
                    for on_node in by_node.values():
                        view._new_group(on_node, "dp_intra_group")
                    for column in zip(*by_node.values()):
                        view._new_group(list(column), "dp_inter_group")
                for d in range(per):
                    view._new_group([view._member(t, d, p, i) for i in range(islands)], "peer_group")
        return view

    def dp_subgroup(self, size: int, copy: int = 0) -> tuple[list[int], ProcessGroup | None]:
        """(ranks, group) of this rank's block of `size` consecutive DP ranks (e.g. PaRO's
        I-level group). Collective on first use per size: every rank must call it, in the
        same order of sizes. `copy` > 0: another group over the same ranks, whose collectives
        are ordered independently of the first's (ZeRO's later stages)."""
        return self._dp_partition("block", size, copy)

    def dp_cross_subgroup(self, size: int, copy: int = 0) -> tuple[list[int], ProcessGroup | None]:
        """(ranks, group) of the DP ranks holding my position inside their own block of `size`
        (one per block): the group that completes a block-level collective to the whole DP
        group. Collective on first use per size, like `dp_subgroup`; `copy` as there."""
        return self._dp_partition("cross", size, copy)

    def _dp_partition(self, kind: str, size: int, copy: int) -> tuple[list[int], ProcessGroup | None]:
        if not isinstance(size, int) or size < 1 or self.dp % size:
            raise TopologyError(
                f"data-parallel sub-group size {size!r} must be a positive divisor of the data-parallel size {self.dp}"
            )
        key = (kind, size, copy)
        if key not in self._subgroups:
            if not dist.is_initialized():
                self._subgroups[key] = ([self.rank], None)
                return self._subgroups[key]
            blocks = [list(range(start, start + size)) for start in range(0, self.dp, size)]
            index_lists = blocks if kind == "block" else [list(c) for c in zip(*blocks)]
            for p in range(self.pp):
                for t in range(self.tp):
                    for island in range(self.islands):
                        for indices in index_lists:
                            members = [self._member(t, d, p, island) for d in indices]
                            group = dist.new_group(members)
                            if self.rank in members:
                                self._subgroups[key] = (members, group)
        return self._subgroups[key]

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the transformer layers this pipeline stage builds."""
        return stage_layer_range(num_layers, self.pp, self.pp_rank)


def stage_layer_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """[start, end) of the transformer layers pipeline stage `stage` of `pp` builds (the
    planner asks it for stages it is not, with no process group)."""
    if num_layers % pp:
        raise TopologyError(f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size {pp}")
    per_stage = num_layers // pp
    return stage * per_stage, (stage + 1) * per_stage


class ModelShape(Protocol):
    """The sizes a tp x pp split must divide: a `ModelConfig` is one (parallel sits below
    model, so it names the attributes instead of importing the class)."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_query_groups(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def ffn_hidden_size(self) -> int | None: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def seq_length(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def moe_ffn_hidden_size(self) -> int | None: ...


def check_model_split(model: ModelShape, tp: int, pp: int, *, sequence_parallel: bool = False) -> None:
    """Reject a model that cannot be split over `tp` x `pp` ranks; needs no process group.

    The one rule every caller applies: the start-up check before any rank starts, the model
    itself (a `GPTModel` built on a TP group: a wrong query-group split would not fail on its
    own, the fused qkv size can divide while a group straddles two ranks), the planner and the
    checkpoint converters."""

    def need(name: str, divisor: int, what: str) -> None:
        value = getattr(model, name)
        if value is not None and value % divisor:
            raise TopologyError(f"model {name} = {value} is not divisible by {what} = {divisor}")

    need("num_attention_heads", tp, "tensor_model_parallel_size")
    need("num_query_groups", tp, "tensor_model_parallel_size")
    need("vocab_size", tp, "tensor_model_parallel_size (pad the vocabulary)")
    need("ffn_hidden_size", tp, "tensor_model_parallel_size")
    need("num_layers", pp, "pipeline_model_parallel_size")
    if model.num_experts:
        need("moe_ffn_hidden_size", tp, "tensor_model_parallel_size")
    if sequence_parallel:
        need("seq_length", tp, "tensor_model_parallel_size (sequence parallelism)")
        if model.num_experts:  # a combination not built, not a split that fails
            raise ConfigError(
                "sequence parallelism with model.num_experts > 0 is not implemented: the router "
                "would see only this rank's sequence chunk; turn one of them off"
            )
