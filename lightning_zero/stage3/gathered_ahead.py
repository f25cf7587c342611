"""``GatheredAhead``: units gathered during the optimizer step for the next forward, and the shards they were
gathered from.

Note [gathered ahead of the forward]
A forward starts with the root unit's gather and the first block's, and nothing runs before them that they could
hide behind: on the benchmark GPT (2 gloo ranks) the forward stood still ~20 ms for them at every step. The
optimizer step, though, computes for tens of milliseconds right before, one bucket at a time (Note [step in
chunks] in ``sharding/sharded_optimizer.py``). At stage 3 it steps the buckets of the units the next forward
gathers first (``ParameterGatherer.lead_units``: the first two of the forward order) before the others, and as soon
as they are stepped issues their gathers, which then run while the rest of the model is stepped. The forward
finds them gathered, as it would find a unit prefetched by the one before it.

A unit gathered ahead holds the shards as they were when its gather was issued. Anything that writes a shard
between the step and the forward (a checkpoint load, an EMA swap, ``gathered(writeback=True)``, a second optimizer
stepping the same unit) bumps the shard's version counter (torch counts every in-place write to a tensor and its
views); the unit's first use compares the versions recorded at the gather with the shards' current ones and
gathers it again if any differs, so a stale parameter is never read. Those writes are collective (every rank loads
the checkpoint, steps, swaps), so every rank regathers, and the gathers stay paired. The memory held ahead is that of
the two units, from the step to the forward that gathers them anyway: below the forward's own peak.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.stage3.sharded_unit import ShardedUnit

_Versions = tuple[tuple[int, int], ...]


def _versions(buckets: Sequence[FlatBucket]) -> _Versions:
    """Each bucket's shard, as (address, version counter): a write in place bumps the counter, a replaced shard
    changes the address."""
    return tuple((b.param_shard.data_ptr(), b.param_shard._version) for b in buckets)


class GatheredAhead:
    """The units gathered ahead of the next forward, with their shards' versions then (Note [gathered ahead of
    the forward])."""

    def __init__(self) -> None:
        self._versions: dict[int, _Versions] = {}

    def record(self, unit: ShardedUnit, buckets: Sequence[FlatBucket]) -> None:
        """``unit``'s gather (of ``buckets``: its own and those of the units merged into it) was just issued."""
        self._versions[unit.index] = _versions(buckets)

    def __contains__(self, unit: ShardedUnit) -> bool:
        return unit.index in self._versions

    def fresh(self, unit: ShardedUnit, buckets: Sequence[FlatBucket]) -> bool:
        """Whether ``unit`` was gathered ahead and no shard of ``buckets`` was written since."""
        return self._versions.get(unit.index) == _versions(buckets)

    def discard(self, unit: ShardedUnit) -> None:
        """``unit`` was used or released: it is an ordinary gathered (or sharded) unit from now on."""
        self._versions.pop(unit.index, None)
