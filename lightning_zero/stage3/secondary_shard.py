"""How a unit's buckets are all-gathered: plainly, or as ZeRO++ does (qwZ quantized, hpZ from a secondary shard).

``ShardedUnit.gather`` hands each bucket to its unit's ``gather_comm``; ``PlainGather`` is the one every unit starts
with, ``ZeroppGather`` the one ``stage3/zeropp.py`` installs when a ZeRO++ switch is on.

Note [secondary shards]
hpZ trades memory for inter-node traffic. After a unit's forward all-gather (over every rank, quantized under qwZ),
each rank copies out its 1/k of the gathered unit, k being ``hpz_partition_size``: the partition of the unit over
the k consecutive ranks of its node. The unit's next gather, its backward one, all-gathers those secondary shards
over the k ranks instead, so it never leaves the node, and it reproduces the forward's values exactly (under qwZ
the dequantized ones: forward and backward see the same weights). A secondary shard serves that one gather and is
dropped by it, so it lives from a unit's forward to its backward: ``params / k`` bytes per rank at most, nothing
after the step. It is made only when gradients are enabled (a forward under ``no_grad`` has no backward to serve).

A secondary shard is valid only while the primary shard it came from is unchanged: the optimizer step, a
checkpoint load, an EMA swap or ``gathered(writeback=True)`` write the primary shard in place, which bumps its
version counter, and a secondary shard made before that is dropped unused. Ranks must agree on which kind of gather
they issue, or the collectives would pair wrongly: they do, since every rank gathers every bucket together and
makes, uses and drops its secondary shards at the same gathers, and writes its primary shards at the same points.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_zero.comm.collectives import PendingCollective, ProcessGroup, all_gather
from lightning_zero.comm.quantization import PackedLayout
from lightning_zero.comm.quantized_all_gather import quantized_all_gather
from lightning_zero.comm.streams import CollectiveStream
from lightning_zero.sharding.flat_bucket import FlatBucket


class PlainGather:
    """The all-gather of stage 3: every rank's exact shard, over the gather group."""

    def gather(
        self, bucket: FlatBucket, flat: Tensor, group: ProcessGroup, stream: CollectiveStream | None = None
    ) -> PendingCollective:
        """Issue the all-gather of ``bucket``'s shards into its full buffer ``flat``."""
        return all_gather(flat, bucket.param_shard, group, stream=stream)

    def secondary_bytes(self) -> int:
        """Bytes of secondary shards held now (Note [secondary shards])."""
        return 0


@dataclass
class _Secondary:
    shard: Tensor
    """The primary shard it was made from, and that tensor's version then."""
    version: int
    values: Tensor
    """(padded_numel / k,) this rank's partition of the gathered bucket."""


class ZeroppGather(PlainGather):
    """qwZ and/or hpZ gathers (Note [secondary shards]). ``hpz_group``: this rank's k consecutive ranks of its node,
    None without hpZ; ``block``: elements per int8 scale, None without qwZ. A bucket whose int8 shard would not be
    smaller than its exact one (a shard of fewer elements than about a block, padded to a whole block) is gathered
    exactly."""

    def __init__(self, hpz_group: ProcessGroup | None, block: int | None) -> None:
        self.hpz_group = hpz_group
        self.block = block
        self._secondary: dict[int, _Secondary] = {}

    def gather(
        self, bucket: FlatBucket, flat: Tensor, group: ProcessGroup, stream: CollectiveStream | None = None
    ) -> PendingCollective:
        secondary = self._secondary.pop(id(bucket), None)
        if secondary is not None and self._valid(bucket, secondary):
            assert self.hpz_group is not None
            return all_gather(flat, secondary.values, self.hpz_group, stream=stream)
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
        shard = bucket.param_shard
        version = shard._version
        first = pending.finish

        def finish() -> None:
            if first is not None:
                first()
            values = flat.view(k, -1)[position].clone()
            self._secondary[id(bucket)] = _Secondary(shard, version, values)

        pending.finish = finish

    def _quantizing_pays(self, bucket: FlatBucket) -> bool:
        """Whether the packed int8 shard is smaller than the exact one: a shard much smaller than a block, padded to
        whole blocks, is not (the same answer on every rank: it depends on the bucket's size only)."""
        assert self.block is not None
        exact = bucket.shard_numel * bucket.param_shard.element_size()
        return PackedLayout(bucket.shard_numel, self.block, 8).row_bytes < exact

    @staticmethod
    def _valid(bucket: FlatBucket, secondary: _Secondary) -> bool:
        shard = bucket.param_shard
        return shard is secondary.shard and shard._version == secondary.version

    def drop(self) -> None:
        """Forget every secondary shard (the primary shards are about to change)."""
        self._secondary.clear()

    def secondary_bytes(self) -> int:
        return sum(s.values.numel() * s.values.element_size() for s in self._secondary.values())
