"""``ShardedGradReducer``: stage 2's (and stage 3's) gradient storage, reduced during every backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.comm.collectives import PendingCollective, ProcessGroup
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.flat_bucket import FlatBucket, ParamSlot
from lightning_zero.sharding.gradient_reducer import BucketState, GradientReducer, accumulate_into


class ShardedGradReducer(GradientReducer):
    """Stage 2: gradients are reduce-scattered during every backward and only this rank's shard is kept.

    Note [staging without memset]
    A bucket collects its gradients in a full-size staging buffer lent by the pool, whose content is stale. Each
    parameter's first gradient of the round is copied into its slot and later ones (a module called twice, local
    accumulation) are added, so a slot is written once instead of zeroed and then added to. Slots that got no
    gradient, and the padding, are zeroed just before the reduction. When autograd is to accumulate into the slot
    itself (``accumulate_into_staging``) that slot is zeroed first, since autograd adds to an existing ``.grad``.
    """

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        group: ProcessGroup,
        config: ZeroConfig,
        ledger: CommLedger,
        on_complete: Callable[[FlatBucket], None] | None = None,
    ) -> None:
        super().__init__(buckets, group, config, ledger, on_complete)
        self.shards = [self._new_shard(b) for b in self.buckets]
        """(shard_numel,) per bucket: this rank's accumulated, averaged gradient."""
        self._shard_is_zero = [True] * len(self.buckets)
        self._staging: list[Tensor | None] = [None] * len(self.buckets)
        self._stale: list[set[int]] = [set() for _ in self.buckets]
        """Offsets of the slots of each staging buffer not yet written this round: Note [staging without memset]."""

    def _new_shard(self, bucket: FlatBucket) -> Tensor:
        """The tensor the bucket's averaged gradient shard is kept in (a subclass may keep it elsewhere)."""
        return torch.zeros(bucket.shard_numel, dtype=self._reduce_dtype(bucket), device=bucket.device)

    def _communicates_now(self) -> bool:
        # Inside no_sync(), "local" accumulation keeps adding into the staging buffers until the last micro-batch.
        return self.require_sync or self.config.grad_accumulation == "sharded"

    def _staging_for(self, bucket: FlatBucket) -> Tensor:
        staging = self._staging[bucket.index]
        if staging is None:
            staging = self.pool.take(bucket.padded_numel, self._reduce_dtype(bucket), bucket.device)
            staging[bucket.numel :].zero_()  # the padding: < world_size elements
            self._staging[bucket.index] = staging
            self._stale[bucket.index] = {slot.offset for slot in bucket.slots}
        return staging

    def accumulate_into_staging(self, bucket: FlatBucket) -> None:
        """Point the bucket's parameters' ``.grad`` at views of its staging buffer, so that the coming backward
        accumulates straight into it (no separate gradient tensors, no copy). Stage 3 calls this when a unit's
        backward is about to start; the buffer is then the only full-size gradient memory of the unit."""
        if bucket.dtype != self._reduce_dtype(bucket):
            return  # autograd produces the parameter dtype; the copy in _store converts it
        staging = self._staging_for(bucket)
        stale = self._stale[bucket.index]
        for slot, param in bucket.slots_and_params():
            if param.grad is None:
                view = FlatBucket.param_view(staging, slot)
                if slot.offset in stale:  # Note [staging without memset]
                    view.zero_()
                    stale.discard(slot.offset)
                param.grad = view

    def _store(self, bucket: FlatBucket, slot: ParamSlot, param: nn.Parameter) -> None:
        view = FlatBucket.param_view(self._staging_for(bucket), slot)
        grad = param.grad
        assert grad is not None
        if grad.data_ptr() != view.data_ptr():
            stale = self._stale[bucket.index]
            if slot.offset in stale:  # Note [staging without memset]
                view.copy_(grad)
                stale.discard(slot.offset)
            else:  # a second gradient in one round: reentrant recomputation, local accumulation
                view.add_(grad)
        param.grad = None  # the full gradient lives on only in the bucket

    def _launch(self, bucket: FlatBucket) -> PendingCollective:
        # No gradient may have arrived on this rank: it still contributes (zeros).
        staging = self._staging_for(bucket)
        for slot in bucket.slots:
            if slot.offset in self._stale[bucket.index]:
                staging[slot.offset : slot.offset + slot.numel].zero_()
        self._stale[bucket.index] = set()
        self._staging[bucket.index] = None
        for param in bucket.params:
            # A view attached by accumulate_into_staging whose gradient never came: the buffer goes back to the
            # pool, so the view must not outlive this round.
            param.grad = None
        self._lent[bucket.index].append(staging)  # back to the pool once the reduction has completed
        shard = self.shards[bucket.index]
        if self._shard_is_zero[bucket.index]:
            self._shard_is_zero[bucket.index] = False
            return self._reduce_scatter(bucket, shard, staging)
        out = torch.empty_like(shard)
        return accumulate_into(shard, out, self._reduce_scatter(bucket, out, staging))

    def grad_shard(self, bucket: FlatBucket) -> Tensor:
        return self.shards[bucket.index]

    def consume(self) -> None:
        # No memset: the next reduction overwrites the shard instead of adding to it.
        self._shard_is_zero = [True] * len(self.buckets)

    def zero_grad(self) -> None:
        self.wait()
        self.consume()
        self.state = [BucketState.FILLING] * len(self.buckets)
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None

    def state_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)
