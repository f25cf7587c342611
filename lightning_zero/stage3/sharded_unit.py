"""``ShardedUnit``: the parameters of one module subtree, gathered and freed together (stage 3)."""

from __future__ import annotations

import enum
from typing import Protocol

from torch import Tensor, nn

from lightning_zero.comm.collectives import ProcessGroup
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.comm.streams import CollectiveStream
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.stage3.gathered_buffers import GatheredBuffers
from lightning_zero.stage3.secondary_shard import PlainGather

_EXACT = PlainGather()


class UnitState(enum.Enum):
    """A unit's parameters over a step. Memory is for the unit's parameters on this rank."""

    SHARDED = "sharded"
    """Only this rank's shard exists; parameters are empty placeholders. 1/N of the unit."""
    GATHERING = "gathering"
    """The all-gather is in flight into freshly allocated full buffers. 1/N + 1 of the unit."""
    GATHERED = "gathered"
    """Parameters are views of the full buffers and may be used. 1/N + 1 of the unit."""


class LiveNumel:
    """Elements of a model's units that the prefetch limit (``ZeroConfig.prefetch_limit_numel``) counts as live:
    every unit not ``SHARDED``, and every unit ``counted_while_sharded`` (freed when its gradients arrived in the
    backward running now: Note [one order of collectives]). A running sum the units update as they change, so that
    a prefetch reads it without looking at every unit."""

    __slots__ = ("numel",)

    def __init__(self) -> None:
        self.numel = 0


class ShardSource(Protocol):
    """Where a unit's shards live between uses when not in memory (the memory tiers, ``lightning_zero.offload``):
    ``acquire`` makes a bucket's ``param_shard`` readable until the matching ``release``."""

    def acquire(self, bucket: FlatBucket) -> Tensor: ...

    def release(self, bucket: FlatBucket) -> None: ...


class ShardedUnit:
    """A unit module and the sharded buckets of the parameters it owns (see ``wrap_policy``)."""

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        buckets: list[FlatBucket],
        stream: CollectiveStream | None = None,
    ) -> None:
        assert all(not b.resident for b in buckets)
        self.index = index
        """Position in module pre-order; 0 is the root unit."""
        self.name = name or "<root>"
        self.module = module
        self.buckets = buckets
        self.numel = sum(b.padded_numel for b in buckets)
        self.state = UnitState.SHARDED
        self.stream = stream
        """The all-gather stream every unit of the model shares (Note [collective streams]); None: the current one."""
        self._pending: list[tuple[FlatBucket, Tensor, PendingCollective]] = []
        self.gather_comm = PlainGather()
        """How the buckets are all-gathered: plainly, or ZeRO++'s way (``stage3/zeropp.py``)."""
        self.shard_source: ShardSource | None = None
        """Set when the shards live in a memory tier: each is acquired from it while the unit is not SHARDED."""
        self.live = LiveNumel()
        """The sum this unit is counted in; the gatherer gives every unit of a model the same one."""
        self._counted_while_sharded = False
        self._trainable_buckets = [b for b in buckets if b.trainable]

    @property
    def trainable_buckets(self) -> list[FlatBucket]:
        return self._trainable_buckets

    @property
    def counted_live(self) -> bool:
        return self.state is not UnitState.SHARDED or self._counted_while_sharded

    def count_while_sharded(self, counted: bool) -> None:
        """Keep (or stop keeping) the unit in ``live`` even while it is ``SHARDED``."""
        before = self.counted_live
        self._counted_while_sharded = counted
        self._recount(before)

    def _set_state(self, state: UnitState) -> None:
        before = self.counted_live
        self.state = state
        self._recount(before)

    def _recount(self, before: bool) -> None:
        after = self.counted_live
        if after != before:
            self.live.numel += self.numel if after else -self.numel

    def gather(
        self, group: ProcessGroup, ledger: CommLedger, buffers: GatheredBuffers | None = None, exact: bool = False
    ) -> None:
        """Issue the all-gather of every bucket (asynchronously); ``wait()`` makes the parameters usable. The full
        buffers take memory kept in ``buffers`` where it has their size (Note [gathered buffers reused]). ``exact``:
        the shards' own values over ``group``, never ZeRO++'s quantized or secondary gathers (``gathered()``, which
        hands the weights to the user and may write them back)."""
        if self.state is not UnitState.SHARDED:
            return
        comm = _EXACT if exact else self.gather_comm
        for bucket in self.buckets:
            # Allocated on the compute stream, which frees it again in release(): Note [collective streams].
            flat = bucket.allocate_full(buffers.take(bucket.full_nbytes) if buffers is not None else None)
            if self.shard_source is not None:  # makes bucket.param_shard resident until release()
                self.shard_source.acquire(bucket)
            pending = comm.gather(bucket, flat, group, self.stream)
            self._pending.append((bucket, flat, ledger.record(pending)))
        self._set_state(UnitState.GATHERING)

    def wait(self) -> None:
        if self.state is not UnitState.GATHERING:
            return
        for bucket, flat, pending in self._pending:
            pending.wait()  # compute waits for the gather here, and only here
            bucket.attach(flat)
        self._pending.clear()
        self._set_state(UnitState.GATHERED)

    def release(self, keep_in: GatheredBuffers | None = None) -> None:
        """Free the full parameters (waiting first if a gather is still in flight: its buffers must outlive it, and
        the storage must go back to the allocator only once compute is ordered after the gather). With ``keep_in``
        their memory is kept there for another unit's gather (Note [gathered buffers reused])."""
        if self.state is UnitState.SHARDED:
            return
        self.wait()
        for bucket in self.buckets:
            memory = bucket.release(keep_memory=keep_in is not None)
            if memory is not None and keep_in is not None:
                keep_in.give(memory)
            if self.shard_source is not None:
                self.shard_source.release(bucket)
        self._set_state(UnitState.SHARDED)

    def __repr__(self) -> str:
        return f"ShardedUnit({self.index}, {self.name!r}, numel={self.numel}, state={self.state.value})"
