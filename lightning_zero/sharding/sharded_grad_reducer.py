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
    gradient, and the padding, are zeroed just before the reduction. Autograd is not pointed at the staging slots
    (``.grad`` views): it adds into an existing ``.grad``, which needs the slot zeroed first, and it computes each
    gradient into a fresh tensor anyway, so a zeroed slot plus an add costs more than the copy and saves nothing.

    Note [gradient shards between steps]
    ``zero_grad()`` (``set_to_none=True``, torch's default) frees the gradient shards, as torch frees ``.grad``: the
    forward that follows runs without them (2Ψ/N bytes less at the forward's peak, FSDP2's behaviour), and the first
    reduction of the next backward allocates each shard uninitialized and writes all of it. ``set_to_none=False``
    keeps them allocated and only marks them zero.
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
        self.shards: list[Tensor | None] = [self._new_shard(b) for b in self.buckets]
        """(shard_numel,) per bucket: this rank's accumulated, averaged gradient. None until a reduction writes it
        and again after ``zero_grad(set_to_none=True)``: Note [gradient shards between steps]."""
        self._frees_shard = [s is None for s in self.shards]
        """Whether zero_grad frees the bucket's shard: the ones allocated here, not those a subclass keeps."""
        self._shard_is_zero = [True] * len(self.buckets)
        self._staging: list[Tensor | None] = [None] * len(self.buckets)
        self._stale: list[set[int]] = [set() for _ in self.buckets]
        """Offsets of the slots of each staging buffer not yet written this round: Note [staging without memset]."""

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
            param.grad = None  # a gradient assigned by hand, never accumulated: the bucket's round is over
        self._lent[bucket.index].append(staging)  # back to the pool once the reduction has completed
        shard = self.shards[bucket.index]
        if shard is None:  # the reduction writes every element: no memset (Note [gradient shards between steps])
            shard = self.shards[bucket.index] = self._allocate_shard(bucket, torch.empty)
        if self._shard_is_zero[bucket.index]:
            self._shard_is_zero[bucket.index] = False
            return self._reduce_scatter(bucket, shard, staging)
        out = torch.empty_like(shard)
        return accumulate_into(shard, out, self._reduce_scatter(bucket, out, staging))

    def _new_shard(self, bucket: FlatBucket) -> Tensor | None:
        """The tensor the bucket's gradient shard is kept in for the reducer's life; None (here): allocated by the
        first reduction, freed by ``zero_grad`` (a subclass may keep it elsewhere, in a memory tier)."""
        return None

    def _allocate_shard(self, bucket: FlatBucket, factory: Callable[..., Tensor]) -> Tensor:
        return factory(bucket.shard_numel, dtype=self._reduce_dtype(bucket), device=bucket.device)

    def grad_shard(self, bucket: FlatBucket) -> Tensor:
        shard = self.shards[bucket.index]
        if shard is None:  # no reduction since the gradients were set to None: the gradient is zero
            shard = self.shards[bucket.index] = self._allocate_shard(bucket, torch.zeros)
            self._shard_is_zero[bucket.index] = False
        elif self._shard_is_zero[bucket.index]:
            shard.zero_()  # consumed by a step and not reduced into since (Note [staging without memset])
            self._shard_is_zero[bucket.index] = False
        return shard

    def consume(self) -> None:
        # No memset: the next reduction overwrites the shard instead of adding to it.
        self._shard_is_zero = [True] * len(self.buckets)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait()
        self.consume()
        if set_to_none:  # Note [gradient shards between steps]
            self.shards = [None if free else shard for shard, free in zip(self.shards, self._frees_shard, strict=True)]
        self.state = [BucketState.FILLING] * len(self.buckets)
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None

    def state_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards if s is not None)
