"""``ShardedGradReducer``: stage 2's (and stage 3's) gradient storage, reduced during every backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.comm.collectives import reduce_scatter, reduce_scatter_pieces, takes_pieces
from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.sharding.flat_bucket import FlatBucket, ParamSlot
from lightning_zero.sharding.gradient_reducer import GradientReducer, accumulate_into


class ShardedGradReducer(GradientReducer):
    """Stage 2: gradients are reduce-scattered during every backward and only this rank's shard is kept.

    Note [gradients held until launch]
    Each parameter keeps the gradient autograd computed in ``.grad`` (accumulated there by autograd if a second one
    arrives in the round: a module called twice, a reentrant recomputation, local accumulation) until its bucket
    launches; the hook only notes which tensor holds it. At the launch the bucket's content is assembled once: on
    gloo sent as pieces (Note [gradients sent from where autograd put them]), otherwise written into a staging
    buffer lent by the pool with one ``torch.cat`` over the bucket's gradients, zeros where none arrived and the
    padding (converting to the reduction's dtype as it copies). A copy per parameter in the hook (a slice, a view
    and a ``copy_``, ~10 µs of Python each) was the largest part of each gradient's hook. Memory: the gradients live
    until the launch, then the staging buffer exists beside them for the copy, as FSDP2's reduce-scatter input does.

    Note [gradient shards between steps]
    ``zero_grad()`` (``set_to_none=True``, torch's default) frees the gradient shards, as torch frees ``.grad``: the
    forward that follows runs without them (2Ψ/N bytes less at the forward's peak, FSDP2's behaviour), and the first
    reduction of the next backward allocates each shard uninitialized and writes all of it. ``set_to_none=False``
    keeps them allocated and only marks them zero.

    Note [gradients sent from where autograd put them]
    On gloo (``takes_pieces``) a reduce-scatter is a pairwise exchange that can send any number of pieces (Note
    [reduce-scatter on gloo]). A bucket then needs no staging buffer at all: each parameter keeps the gradient
    autograd computed (``.grad``, accumulated in place by autograd if a second one arrives in the round) until the
    bucket launches, and the pieces of those tensors that make up each rank's chunk are sent as they are, the padding
    and any gradient that never arrived as zeros (``reduce_scatter_pieces``). That saves copying every gradient into
    a staging buffer (~28 ms of CPU per step on the 25M-parameter benchmark GPT, a pass over 4Ψ bytes) and the
    staging buffers themselves, which stage 2 kept pooled between steps (Note [buffers between steps]) and stage 3
    faulted in every backward. Memory during backward is the same: the gradients stay alive exactly as long as their
    copies did. NCCL's reduce-scatter needs one flat input, and so do fp16 (divided before the sum, Note [when to
    average]), a reduction in another dtype than the gradients' (a copy converts them anyway) and ZeRO++'s quantized
    reduce-scatter: those keep the staging buffer.
    """

    def _init_storage(self) -> None:
        self.shards: list[Tensor | None] = [self._new_shard(b) for b in self.buckets]
        """(shard_numel,) per bucket: this rank's accumulated, averaged gradient. None until a reduction writes it
        and again after ``zero_grad(set_to_none=True)``: Note [gradient shards between steps]."""
        self._frees_shard = [s is None for s in self.shards]
        """Whether zero_grad frees the bucket's shard: the ones allocated here, not those a subclass keeps."""
        self._shard_is_zero = [True] * len(self.buckets)
        group = self.group
        self.advise_shard: Callable[[Tensor], object] | None = None
        """Called with each gradient shard allocated here, before anything writes it: the host step advises a CPU
        device's onto huge pages (Note [huge pages] in ``offload/host_arena.py``)."""
        self._pieces_possible = [
            takes_pieces(b.device, group) and self._reduce_dtype(b) == b.dtype != torch.float16 for b in self.buckets
        ]
        self._held: list[dict[int, Tensor] | None] = [None] * len(self.buckets)
        """Per bucket with gradients this round: slot offset -> the gradient autograd left in ``.grad`` (Note
        [gradients held until launch]); None before the bucket's first gradient of the round."""
        self._zeros: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
        self._cuts: dict[int, list[tuple[int, int, int, int]]] = {}

    def _communicates_now(self) -> bool:
        # Inside no_sync(), "local" accumulation keeps adding into the staging buffers until the last micro-batch.
        return self.require_sync or self.config.grad_accumulation == "sharded"

    def _store(self, bucket: FlatBucket, slot: ParamSlot, param: nn.Parameter) -> None:
        grad = param.grad
        assert grad is not None
        held = self._held[bucket.index]
        if held is None:
            held = self._held[bucket.index] = {}
        held[slot.offset] = grad  # the latest .grad holds everything accumulated this round

    def _take_held(self, bucket: FlatBucket) -> list[Tensor]:
        """The bucket's content, item by item, ending its round (Note [gradients held until launch]): each
        gradient flat (zeros where none arrived on this rank: it still contributes), then the padding."""
        held = self._held[bucket.index] or {}
        self._held[bucket.index] = None
        for param in bucket.params:
            # The gradients live on in what the launch builds from them; one assigned by hand, never accumulated,
            # is dropped: the bucket's round is over.
            param.grad = None
        items = [
            held[s.offset].reshape(-1) if s.offset in held else self._zeros_of(s.numel, bucket) for s in bucket.slots
        ]
        items.append(self._zeros_of(bucket.padded_numel - bucket.numel, bucket))
        return items

    def _launch(self, bucket: FlatBucket) -> PendingCollective:
        if self._pieces_possible[bucket.index] and self.reduce_scatter is reduce_scatter:  # gloo's, not qgZ's
            return self._launch_pieces(bucket)
        staging = self.pool.take(bucket.padded_numel, self._reduce_dtype(bucket), bucket.device)
        torch.cat(self._take_held(bucket), out=staging)  # one copy per bucket, converting to the reduction's dtype
        self._lent[bucket.index].append(staging)  # back to the pool once the reduction has completed
        return self._into_shard(bucket, lambda output: self._reduce_scatter(bucket, output, staging))

    def _into_shard(self, bucket: FlatBucket, reduce: Callable[[Tensor], PendingCollective]) -> PendingCollective:
        """Issue ``reduce(output)`` straight into the bucket's gradient shard, or into a temporary added to it once
        complete when the shard already holds gradients of this step (sharded accumulation)."""
        shard = self.shards[bucket.index]
        if shard is None:  # the reduction writes every element: no memset (Note [gradient shards between steps])
            shard = self.shards[bucket.index] = self._allocate_shard(bucket, torch.empty)
        if self._shard_is_zero[bucket.index]:
            self._shard_is_zero[bucket.index] = False
            return reduce(shard)
        out = torch.empty_like(shard)
        return accumulate_into(shard, out, reduce(out))

    def _launch_pieces(self, bucket: FlatBucket) -> PendingCollective:
        """Note [gradients sent from where autograd put them]: each rank's chunk as pieces of the gradients."""
        # A .grad of another dtype (a hook's) is converted, as the copy into a staging buffer would.
        items = [item.to(bucket.dtype) for item in self._take_held(bucket)]
        chunks: list[list[Tensor]] = [[] for _ in range(self.world_size)]
        for item, start, stop, rank in self._cuts_of(bucket):
            chunks[rank].append(items[item][start:stop])
        spare = (self.world_size - 2) * bucket.shard_numel
        scratch = self.pool.take(spare, bucket.dtype, bucket.device) if spare else None
        if scratch is not None:
            self._lent[bucket.index].append(scratch)

        def reduce(output: Tensor) -> PendingCollective:
            return reduce_scatter_pieces(output, chunks, self.group, scratch=scratch, stream=self.stream)

        return self._into_shard(bucket, reduce)

    def _cuts_of(self, bucket: FlatBucket) -> list[tuple[int, int, int, int]]:
        """How the bucket's content (its slots in order, then the padding as item ``len(slots)``) is cut at chunk
        boundaries: ``(item, start, stop, rank)`` per piece, ``start:stop`` within the item. Computed once."""
        cuts = self._cuts.get(bucket.index)
        if cuts is None:
            cuts = []
            extents = [slot.numel for slot in bucket.slots] + [bucket.padded_numel - bucket.numel]
            start = 0  # of the item within the bucket
            for item, numel in enumerate(extents):
                offset, end = start, start + numel
                while offset < end:
                    rank = offset // bucket.shard_numel
                    stop = min(end, (rank + 1) * bucket.shard_numel)
                    cuts.append((item, offset - start, stop - start, rank))
                    offset = stop
                start = end
            self._cuts[bucket.index] = cuts
        return cuts

    def _zeros_of(self, numel: int, bucket: FlatBucket) -> Tensor:
        """A zero contribution of ``numel`` elements (padding, or a gradient that never arrived), read-only."""
        key = (numel, bucket.dtype, bucket.device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(numel, dtype=bucket.dtype, device=bucket.device)
        return self._zeros[key]

    def _new_shard(self, bucket: FlatBucket) -> Tensor | None:
        """The tensor the bucket's gradient shard is kept in for the reducer's life; None (here): allocated by the
        first reduction, freed by ``zero_grad`` (a subclass may keep it elsewhere, in a memory tier)."""
        return None

    def _allocate_shard(self, bucket: FlatBucket, factory: Callable[..., Tensor]) -> Tensor:
        if self.advise_shard is None:
            return factory(bucket.shard_numel, dtype=self._reduce_dtype(bucket), device=bucket.device)
        shard = torch.empty(bucket.shard_numel, dtype=self._reduce_dtype(bucket), device=bucket.device)
        self.advise_shard(shard)
        return shard.zero_() if factory is torch.zeros else shard

    def grad_shard(self, bucket: FlatBucket) -> Tensor:
        shard = self.shards[bucket.index]
        if shard is None:  # no reduction since the gradients were set to None: the gradient is zero
            shard = self.shards[bucket.index] = self._allocate_shard(bucket, torch.zeros)
            self._shard_is_zero[bucket.index] = False
        elif self._shard_is_zero[bucket.index]:
            shard.zero_()  # consumed by a step and not reduced into since (no memset at the step)
            self._shard_is_zero[bucket.index] = False
        return shard

    def _consume(self, buckets: Sequence[FlatBucket]) -> None:
        # No memset: the next reduction overwrites the shard instead of adding to it.
        for bucket in buckets:
            self._shard_is_zero[bucket.index] = True

    def _zero_spans(self, bucket: FlatBucket, owner: int) -> None:
        zero = self.shards[bucket.index] is None or self._shard_is_zero[bucket.index]
        if not zero or self._has_local_gradients(bucket):  # (the latter refuses)
            super()._zero_spans(bucket, owner)

    def _has_local_gradients(self, bucket: FlatBucket) -> bool:
        return self._held[bucket.index] is not None

    def _zero_grad(self, buckets: Sequence[FlatBucket], set_to_none: bool) -> None:
        self._consume(buckets)
        for bucket in buckets:
            i = bucket.index
            # Gradients of a round that was never reduced (a local no_sync backward) are dropped: they were held
            # where autograd left them (Note [gradients held until launch]), in .grad, cleared below.
            self._held[i] = None
            if set_to_none and self._frees_shard[i]:  # Note [gradient shards between steps]
                self.shards[i] = None
            for param in bucket.params:
                param.grad = None

    def state_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards if s is not None)
