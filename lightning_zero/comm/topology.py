"""``NodeTopology``: which ranks share a node, and the process groups of ZeRO++'s two-level communication.

Note [node topology]
Ranks are placed on nodes in consecutive blocks (torchrun, SLURM's block distribution and Lightning all number rank
``node_rank * ranks_per_node + local_rank``), so global rank ``g`` lives on node ``g // ranks_per_node``. The size of
a block comes from ``ZeroConfig.ranks_per_node`` or, when that is None, from the cluster environment
(``ranks_per_node_from_environment``); one machine can thus pretend to be several nodes (4 ranks as 2 nodes x 2),
which is how ZeRO++ is tested on a CPU. The topology is pure arithmetic on global ranks: the ledger uses it to
split the bytes of each call by link (Note [bytes by link] in ``ledger.py``).

Process groups are built once, by ``build_node_groups``: ``torch.distributed.new_group`` is collective over the
*default* group, so every rank creates every group, in the same order, including the groups it is not a member of.
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


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """This rank's two groups of a two-level collective: its node, and its peers of the same local index."""

    intra: ProcessGroup
    """The ranks of this rank's node (or partition, for hpZ), in rank order."""
    inter: ProcessGroup | None
    """The ranks with this rank's position in every other node, in node order; None when not built."""


def build_node_groups(ranks: list[int], partition_size: int, timeout: timedelta, *, with_inter: bool) -> NodeGroups:
    """Groups over ``ranks`` (a ZeRO group's global ranks, in group order) cut into blocks of ``partition_size``:
    the block of this rank, and (``with_inter``) the ranks sharing its position in every block. Every rank of the
    default group must call this with the same arguments (Note [node topology])."""
    me = dist.get_rank()
    blocks = [ranks[i : i + partition_size] for i in range(0, len(ranks), partition_size)]
    intra: ProcessGroup | None = None
    for block in blocks:
        group = dist.new_group(block, timeout=timeout)
        if me in block:
            intra = group
    inter: ProcessGroup | None = None
    if with_inter:
        for position in range(partition_size):
            column = [block[position] for block in blocks]
            group = dist.new_group(column, timeout=timeout)
            if me in column:
                inter = group
    assert intra is not None, (me, ranks)
    return NodeGroups(intra, inter)
