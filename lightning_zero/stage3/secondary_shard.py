"""How a unit's buckets are all-gathered: plainly, or as ZeRO++ does (qwZ quantized, hpZ from a secondary shard).

``ShardedUnit.gather`` hands each bucket to its unit's ``gather_comm``; ``PlainGather`` is the one every unit starts
with, ``ZeroppGather`` the one ``stage3/zeropp.py`` installs when a ZeRO++ switch is on.

Note [secondary shards]
hpZ trades memory for inter-node traffic. After a unit's forward all-gather (over every rank, quantized under qwZ),
each rank copies out its 1/k of the gathered unit, k being ``hpz_partition_size``: the partition of the unit over
the k consecutive ranks of its node. Every later gather of the unit, its backward one first, all-gathers those
secondary shards over the k ranks instead, so it never leaves the node, and it reproduces the forward's values
exactly (under qwZ the dequantized ones: forward and backward see the same weights).

Which group a gather goes to must be the same decision on every rank, or the collectives pair wrongly and the ranks
hang (a rank in a node's all-gather, its peer in the whole group's). So whether a bucket has a secondary shard is
never judged from anything local (whether this rank's primary shard was written: a step writes only the ranks whose
slice holds a stepped parameter, and the memory tiers write shards behind the tensor's back). It is a lifecycle
state driven only by events every rank sees at the same point of the same program:

- made: by a full gather of the bucket issued with gradients enabled while it has none (a forward's, or a
  recomputation's in backward); the gather is collective, so every rank makes one;
- used: by every gather of the bucket while it is valid (backward, a second micro-batch's forward, a recomputation);
  using it does not drop it, so however many of those gathers run, they all agree. ``gathered()`` never uses one:
  it gathers the primary shards exactly over the whole group, on every rank alike (``ShardedUnit.gather(exact=)``);
- dropped, all at once: by ``invalidate()``, which ``ParameterGatherer.invalidate_secondaries`` calls wherever
  primary shards may have been written, on every rank together: the optimizer step (each ``refresh_gathered``:
  every step of every optimizer, a checkpoint load, an EMA swap) and ``gathered(writeback=True)``. A full gather
  issued before an invalidation but finishing after it makes nothing (``_generation``): its values may be older.

So a secondary shard never serves weights older than its primary shard, and one that outlives its backward (the
root kept gathered into backward, a unit autograd never reaches, ``gathered()`` between backward and the step, a
second optimizer's step, manual optimization) is dropped at the next step on every rank at once. Memory: ``params /
k`` bytes per rank at most, from a unit's first forward of a step to the step; nothing after it (except the
secondaries of a forward no step followed, e.g. the last one before ``fit`` ends). None is made under ``no_grad``
(an evaluation forward has no backward to serve), though one may serve it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.comm.collectives import ProcessGroup, all_gather
from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.comm.quantization import PackedLayout
from lightning_zero.comm.quantized_all_gather import quantized_all_gather
from lightning_zero.comm.streams import CollectiveStream
from lightning_zero.sharding.flat_bucket import FlatBucket


class PlainGather:
    """The all-gather of stage 3: every rank's exact shard, over the gather group."""

    lossy = False
    """Whether the gathered values may differ from the shards (qwZ's int8): ``gathered()`` then gathers exactly."""

    def gather(
        self, bucket: FlatBucket, flat: Tensor, group: ProcessGroup, stream: CollectiveStream | None = None
    ) -> PendingCollective:
        """Issue the all-gather of ``bucket``'s shards into its full buffer ``flat``."""
        return all_gather(flat, bucket.param_shard, group, stream=stream)

    def invalidate(self) -> None:
        """The primary shards may have changed: no secondary shard made before serves a gather again (Note
        [secondary shards]). Nothing to do here."""

    def secondary_bytes(self) -> int:
        """Bytes of secondary shards held now (Note [secondary shards])."""
        return 0


class ZeroppGather(PlainGather):
    """qwZ and/or hpZ gathers (Note [secondary shards]). ``hpz_group``: this rank's k consecutive ranks of its node,
    None without hpZ; ``block``: elements per int8 scale, None without qwZ. A bucket whose int8 shard would not be
    smaller than its exact one (a shard of fewer elements than about a block, padded to a whole block) is gathered
    exactly."""

    def __init__(self, hpz_group: ProcessGroup | None, block: int | None) -> None:
        self.hpz_group = hpz_group
        self.block = block
        self.lossy = block is not None
        self._secondary: dict[int, Tensor] = {}
        """By ``id(bucket)``: this rank's (padded_numel / k,) partition of the gathered bucket."""
        self._generation = 0
        """Counts invalidations: a gather's secondary shard is kept only if none happened while it was in flight."""

    def gather(
        self, bucket: FlatBucket, flat: Tensor, group: ProcessGroup, stream: CollectiveStream | None = None
    ) -> PendingCollective:
        secondary = self._secondary.get(id(bucket))
        if secondary is not None:  # the same on every rank: Note [secondary shards]
            assert self.hpz_group is not None
            return all_gather(flat, secondary, self.hpz_group, stream=stream)
        if self.block is not None and self._quantizing_pays(bucket):
            pending = quantized_all_gather(flat, bucket.param_shard, group, self.block, stream=stream)
        else:
            pending = all_gather(flat, bucket.param_shard, group, stream=stream)
        if self.hpz_group is not None and torch.is_grad_enabled():
            self._keep_secondary_after(pending, bucket, flat)
        return pending

    def _keep_secondary_after(self, pending: PendingCollective, bucket: FlatBucket, flat: Tensor) -> None:
        assert self.hpz_group is not None
        k, position = self.hpz_group.size(), self.hpz_group.rank()
        generation = self._generation
        first = pending.finish

        def finish() -> None:
            if first is not None:
                first()
            if self._generation == generation:  # no shard was written since the gather was issued
                self._secondary[id(bucket)] = flat.view(k, -1)[position].clone()

        pending.finish = finish

    def _quantizing_pays(self, bucket: FlatBucket) -> bool:
        """Whether the packed int8 shard is smaller than the exact one: a shard much smaller than a block, padded to
        whole blocks, is not (the same answer on every rank: it depends on the bucket's size only)."""
        assert self.block is not None
        exact = bucket.shard_numel * bucket.param_shard.element_size()
        return PackedLayout(bucket.shard_numel, self.block, 8).row_bytes < exact

    def invalidate(self) -> None:
        self._secondary.clear()
        self._generation += 1

    def secondary_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._secondary.values())
