"""ZeRO++ on a stage-3 model: the node topology, its process groups, and the communicators each switch installs.

Note [ZeRO++ on a node topology]
ZeRO++ (Wang et al., 2023) cuts stage 3's cross-node traffic, 3M per step for M the model's 16-bit bytes, with
three independent switches of ``ZeroConfig``:

- qwZ (``quantize_weights``): the forward all-gather sends int8 with block scales, 0.5M
  (``comm/quantized_all_gather.py``);
- hpZ (``hpz_partition_size``): the backward all-gather reads secondary shards kept inside the node, 0
  (Note [secondary shards] in ``secondary_shard.py``);
- qgZ (``quantize_gradients``): the reduce-scatter is a quantized all-to-all within the node, then across nodes,
  0.25M with int4 (Note [hierarchical reduce-scatter] in ``comm/hierarchical_reduce.py``).

``install_zeropp`` runs once, when ``shard_module`` has built the units: it resolves the topology (Note [node
topology] in ``comm/topology.py``), checks that it divides, builds the groups the switches need (every rank of the
ZeRO group, which may be a subset of the world, in the same order) and swaps each unit's ``gather_comm`` and the
reducer's ``reduce_scatter``. Nothing else in stage 3 knows about ZeRO++: units, hooks, the reducer's ordering and
the optimizer are those of plain stage 3, and the shards, fp32 masters and checkpoints stay exact (only what
travels is quantized).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lightning_zero.comm.collectives import ProcessGroup
from lightning_zero.comm.hierarchical_reduce import HierarchicalReduceScatter
from lightning_zero.comm.topology import NodeTopology, build_node_groups, group_ranks_per_node
from lightning_zero.config import ZeroConfig
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.secondary_shard import ZeroppGather


def _world_of(group: ProcessGroup) -> int:
    """The size of the whole world ``group`` is part of (Note [node topology]): nodes are counted over it."""
    return dist.get_world_size() if dist.is_initialized() else group.size()


def resolve_topology(config: ZeroConfig, group: ProcessGroup) -> tuple[NodeTopology, int]:
    """The world's node topology and how many of ``group``'s ranks each node holds, checked against the ZeRO++
    switches (errors name the field, value and fix)."""
    world = _world_of(group)
    topology = NodeTopology.resolve(world, config.ranks_per_node)
    ranks = dist.get_process_group_ranks(group) if dist.is_initialized() else list(range(world))
    per_node = group_ranks_per_node(ranks, topology)
    k = config.hpz_partition_size
    if k > 1 and per_node % k:
        raise ValueError(
            f"Invalid ZeroConfig.hpz_partition_size: {k} with {per_node} ranks of the ZeRO group per node (world of "
            f"{world}, {topology.ranks_per_node} ranks per node). Expected a divisor of the group's ranks per node, so "
            f"that a secondary shard's partition stays inside one node. HINT: hpz_partition_size={per_node}, or set "
            "ranks_per_node."
        )
    return topology, per_node


def metering_topology(config: ZeroConfig, group: ProcessGroup) -> NodeTopology | None:
    """The topology to split a run's bytes by link with; None (one node) where the environment's ranks per node
    do not divide the world, which only matters to ZeRO++ and is refused there."""
    try:
        return NodeTopology.resolve(_world_of(group), config.ranks_per_node)
    except ValueError:
        return None


def install_zeropp(gatherer: ParameterGatherer, config: ZeroConfig, group: ProcessGroup) -> ParameterGatherer:
    """Meter ``gatherer``'s communication by link and, for each ZeRO++ switch that is on, install its
    communicator (Note [ZeRO++ on a node topology]). Returns ``gatherer``."""
    if not config.uses_zeropp:
        gatherer.ledger.topology = metering_topology(config, group)
        return gatherer
    topology, per_node = resolve_topology(config, group)
    gatherer.ledger.topology = topology
    if group.size() == 1:
        return gatherer
    ranks = dist.get_process_group_ranks(group)
    timeout = timedelta(seconds=config.collective_timeout_s)
    hpz_group = None
    if config.hpz_partition_size > 1:
        hpz_group = build_node_groups(ranks, config.hpz_partition_size, timeout, with_inter=False).intra
    if config.quantize_weights or hpz_group is not None:
        block = config.quantization_block if config.quantize_weights else None
        comm = ZeroppGather(hpz_group, block)
        for unit in gatherer.units:
            unit.gather_comm = comm
    if config.quantize_gradients:
        nodes = build_node_groups(ranks, per_node, timeout, with_inter=True)
        assert nodes.inter is not None
        bits = config.gradient_quantization_bits
        gatherer.reducer.reduce_scatter = HierarchicalReduceScatter(
            nodes.intra, nodes.inter, bits, config.quantization_block
        )
    return gatherer


def secondary_shard_bytes(gatherer: ParameterGatherer, config: ZeroConfig) -> int:
    """Bytes of hpZ secondary shards this rank holds once every unit's forward has run, until the step: the
    sharded parameters / ``hpz_partition_size`` (Note [secondary shards]); 0 without hpZ."""
    k = config.hpz_partition_size
    if k == 1:
        return 0
    return sum(b.padded_numel // k * b.param_shard.element_size() for u in gatherer.units for b in u.buckets)
