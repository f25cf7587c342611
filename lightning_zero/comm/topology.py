"""``NodeTopology``: which ranks share a node, and the process groups of ZeRO++'s two-level communication.

Note [node topology]
Ranks are placed on nodes in consecutive blocks (torchrun, SLURM's block distribution and Lightning all number rank
``node_rank * ranks_per_node + local_rank``), so global rank ``g`` lives on node ``g // ranks_per_node``. The size of
a block comes from ``ZeroConfig.ranks_per_node`` or, when that is None, from the cluster environment
(``ranks_per_node_from_environment``); one machine can thus pretend to be several nodes (4 ranks as 2 nodes x 2),
which is how ZeRO++ is tested on a CPU. The topology is pure arithmetic on global ranks, over the whole world: the
ledger uses it to split the bytes of each call by link (Note [bytes by link] in ``ledger.py``).

A ZeRO process group may be a subset of the world (data parallelism inside each of several model replicas). Its
ranks, in group order (``new_group`` sorts them, so in global order too), then fall on nodes in runs; ZeRO++ needs
every node to hold the same number of them (``group_ranks_per_node``), and cuts its node groups out of those runs.

Process groups are built once, by ``build_node_groups``, with ``use_local_synchronization``: only the members of a
group create it, so it is enough that the ZeRO group's ranks call it (a plain ``new_group`` is collective over the
whole default group, and would wait forever for the ranks outside a ZeRO group that is a subset). torch names such
a group after its ranks and the number of groups the creating rank already has; the members of a node group are
ranks of one ZeRO group that have run the same program so far, so they agree on both.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

from lightning_zero.comm.collectives import ProcessGroup

Link = Literal["intra_node", "inter_node"]
LINKS: tuple[Link, ...] = ("intra_node", "inter_node")


def ranks_per_node_from_environment() -> int | None:
    """Ranks per node as the launcher says: torchrun's ``LOCAL_WORLD_SIZE``, else SLURM's
    ``SLURM_NTASKS_PER_NODE`` (``"4"`` or ``"4(x2)"``); None when neither is set."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    slurm = os.environ.get("SLURM_NTASKS_PER_NODE")
    if slurm:
        match = re.match(r"(\d+)", slurm)
        if match:
            return int(match.group(1))
    return None


@dataclass(frozen=True, slots=True)
class NodeTopology:
    """``world_size`` ranks on nodes of ``ranks_per_node`` consecutive ranks (Note [node topology])."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node <= 0 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"Invalid ZeroConfig.ranks_per_node: {self.ranks_per_node} for a world of {self.world_size} ranks. "
                "Expected a divisor of the world size (every node runs the same number of ranks). HINT: set "
                "ranks_per_node to the processes per node, or None to read it from the cluster environment."
            )

    @classmethod
    def resolve(cls, world_size: int, ranks_per_node: int | None) -> NodeTopology:
        """``ranks_per_node`` if given, else from the environment, else one node of ``world_size`` ranks."""
        per_node = ranks_per_node or ranks_per_node_from_environment() or world_size
        return cls(world_size, min(per_node, world_size))

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_node

    def link(self, source: int, destination: int) -> Link:
        """The link a message from global rank ``source`` to ``destination`` crosses."""
        return "intra_node" if self.node_of(source) == self.node_of(destination) else "inter_node"

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))


def group_ranks_per_node(ranks: list[int], topology: NodeTopology) -> int:
    """How many of ``ranks`` (a ZeRO group's global ranks) each node holds; every node holding any must hold the same
    number, or ZeRO++'s node groups would differ in size (Note [node topology])."""
    counts: dict[int, int] = {}
    for rank in ranks:
        counts[topology.node_of(rank)] = counts.get(topology.node_of(rank), 0) + 1
    if len(set(counts.values())) != 1:
        per_node = ", ".join(f"node {node}: {n}" for node, n in sorted(counts.items()))
        raise ValueError(
            f"Invalid ZeRO process group for ZeRO++: its ranks {ranks} fall unevenly on nodes of "
            f"{topology.ranks_per_node} ranks ({per_node}). Expected the same number of the group's ranks on every "
            "node it spans, so that hpZ's partitions and qgZ's two levels are the same on every node. HINT: build the "
            "ZeRO group from whole nodes or from the same local ranks of every node, or check ranks_per_node."
        )
    return next(iter(counts.values()))


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """This rank's two groups of a two-level collective: its node, and its peers of the same local index."""

    intra: ProcessGroup
    """The ranks of this rank's node (or partition, for hpZ), in rank order."""
    inter: ProcessGroup | None
    """The ranks with this rank's position in every other node, in node order; None when not built."""


def build_node_groups(ranks: list[int], partition_size: int, timeout: timedelta, *, with_inter: bool) -> NodeGroups:
    """Groups over ``ranks`` (a ZeRO group's global ranks, in group order) cut into blocks of ``partition_size``:
    the block of this rank, and (``with_inter``) the ranks sharing its position in every block. Every rank of
    ``ranks`` calls this with the same arguments, and only those (Note [node topology])."""
    me = dist.get_rank()
    assert me in ranks, (me, ranks)
    assert len(ranks) % partition_size == 0, (ranks, partition_size)
    blocks = [ranks[i : i + partition_size] for i in range(0, len(ranks), partition_size)]
    mine = ranks.index(me)
    block = blocks[mine // partition_size]
    intra = dist.new_group(block, timeout=timeout, use_local_synchronization=True)
    inter = None
    if with_inter:
        column = [b[mine % partition_size] for b in blocks]
        inter = dist.new_group(column, timeout=timeout, use_local_synchronization=True)
    return NodeGroups(intra, inter)
