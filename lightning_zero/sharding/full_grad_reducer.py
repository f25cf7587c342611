"""``FullGradReducer``: stage 1's gradient storage, full buffers reduced once per optimizer step."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.sharding.flat_bucket import FlatBucket, ParamSlot
from lightning_zero.sharding.gradient_reducer import BucketState, GradientReducer, accumulate_into


class FullGradReducer(GradientReducer):
    """Stage 1: full gradient buffers, ``param.grad`` as views; reduced at the last backward or the step.

    Note [full gradients between steps]
    As torch frees ``.grad`` on ``zero_grad()`` (``set_to_none=True``, its default), stage 1 frees its full gradient
    buffers there, so the forward that follows (the step's memory peak is at the start of the next backward, when
    the activations are all alive) runs without 2Ψ bytes of zeros in fp16 (4Ψ in fp32); DDP holds its bucket copy
    of the gradients there. The first gradient of a bucket in the next backward allocates its buffer uninitialized:
    each parameter's first gradient is copied into its slot and the parameter's ``.grad`` becomes a view of the
    slot, so later micro-batches accumulate in place; slots that got no gradient, and the padding, are zeroed just
    before the reduction (Note [staging without memset]). ``set_to_none=False`` keeps the buffers and zeroes them.

    Note [staging without memset]
    A buffer allocated uninitialized is written once per slot: each parameter's first gradient of the round is
    copied into its slot, later ones are added (autograd, into the view), and only the slots that got no gradient and
    the padding are zeroed, just before the reduction, instead of zeroing the whole buffer and then adding to it.

    Note [reduced shard in place]
    A reduction writes this rank's averaged shard into this rank's own slice of the bucket's gradient buffer (the
    collective allows that aliasing) and zeroes the rest, so the averaged gradient needs no memory of its own; the
    step reads it there and ``consume()`` zeroes the slice for the next backward. A second backward with sync on
    before the step (manual optimization) would accumulate into that slice: a hook that runs before each gradient
    is accumulated first moves the average out to a separate tensor, and later reductions add into that one, so
    several such backward passes add up, exactly like DDP's in-place all-reduce.
    """

    def _init_storage(self) -> None:
        self.grads: list[Tensor | None] = [None] * len(self.buckets)
        """(padded_numel,) per bucket, parameters' ``.grad`` are views into it; None between ``zero_grad()`` and the
        bucket's first gradient (Note [full gradients between steps])."""
        self._stale: list[set[int]] = [set() for _ in self.buckets]
        """Offsets of the slots of each buffer no gradient has written since it was allocated."""
        self._reduced: list[Tensor | None] = [None] * len(self.buckets)
        """(shard_numel,) per bucket once reduced in this step: the averaged gradient shard."""
        self._in_place = [False] * len(self.buckets)
        """Whether ``_reduced`` is this rank's slice of the gradient buffer: Note [reduced shard in place]."""
        self._attach_grad_views()
        for bucket in self.buckets:
            for param in bucket.params:
                self._handles.append(param.register_hook(partial(self._before_accumulate, bucket)))

    def _before_accumulate(self, bucket: FlatBucket, grad: Tensor) -> None:
        self._move_out(bucket)

    def _move_out(self, bucket: FlatBucket) -> None:
        """Give a reduced shard held in place its own tensor, before the buffer takes new gradients."""
        flat = self.grads[bucket.index]
        if self._in_place[bucket.index]:  # Note [reduced shard in place]
            assert flat is not None
            own = bucket.shard_of(flat)
            self._reduced[bucket.index] = own.clone()
            own.zero_()
            self._in_place[bucket.index] = False

    def _attach_grad_views(self) -> None:
        for bucket, flat in zip(self.buckets, self.grads, strict=True):
            if flat is None:
                continue
            for slot, param in bucket.slots_and_params():
                param.grad = FlatBucket.param_view(flat, slot)

    def _buffer(self, bucket: FlatBucket) -> Tensor:
        """The bucket's gradient buffer, allocated uninitialized if it was freed: Note [full gradients between
        steps]."""
        flat = self.grads[bucket.index]
        if flat is None:
            flat = self.grads[bucket.index] = torch.empty(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
            flat[bucket.numel :].zero_()  # the padding: < world_size elements
            self._stale[bucket.index] = {slot.offset for slot in bucket.slots}
        return flat

    def _zero_stale(self, bucket: FlatBucket) -> Tensor:
        """The bucket's buffer with every slot no gradient wrote zeroed: ready to be reduced."""
        flat = self._buffer(bucket)
        for slot in bucket.slots:
            if slot.offset in self._stale[bucket.index]:
                flat[slot.offset : slot.offset + slot.numel].zero_()
        self._stale[bucket.index] = set()
        return flat

    def _communicates_now(self) -> bool:
        return self.require_sync and self.config.overlap_comm

    def _store(self, bucket: FlatBucket, slot: ParamSlot, param: nn.Parameter) -> None:
        view = FlatBucket.param_view(self._buffer(bucket), slot)
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            # The slot's first gradient since the buffer was allocated (Note [full gradients between steps]), or
            # something replaced .grad (``module.zero_grad(set_to_none=True)``): autograd then allocated a fresh
            # tensor holding this backward's gradient. Fold it into the flat buffer; autograd accumulates into the
            # view from now on.
            view.copy_(grad)
            param.grad = view
        self._stale[bucket.index].discard(slot.offset)

    def _launch(self, bucket: FlatBucket) -> PendingCollective:
        self._move_out(bucket)  # a second reduction in one step of a bucket that got no gradient in between
        flat = self._zero_stale(bucket)
        reduce_dtype = self._reduce_dtype(bucket)
        if reduce_dtype == flat.dtype and self._reduced[bucket.index] is None:
            own = bucket.shard_of(flat)  # Note [reduced shard in place]
            self._reduced[bucket.index] = own
            self._in_place[bucket.index] = True
            return self._reduce_scatter(bucket, own, flat)
        send = flat if reduce_dtype == flat.dtype else flat.to(reduce_dtype)
        out = torch.empty(bucket.shard_numel, dtype=reduce_dtype, device=flat.device)
        pending = self._reduce_scatter(bucket, out, send)
        total = self._reduced[bucket.index]
        if total is None:
            self._reduced[bucket.index] = out
            return pending
        return accumulate_into(total, out, pending)

    def _complete(self, bucket: FlatBucket) -> None:
        # Its content now lives, averaged, in the reduced shard: the rest of the buffer starts the next backward.
        flat = self.grads[bucket.index]
        assert flat is not None
        if not self._in_place[bucket.index]:
            flat.zero_()
            return
        own = bucket.rank * bucket.shard_numel
        flat[:own].zero_()
        flat[own + bucket.shard_numel :].zero_()

    def grad_shard(self, bucket: FlatBucket) -> Tensor:
        reduced = self._reduced[bucket.index]
        assert reduced is not None, f"{bucket} was not reduced; call finish() first"
        return reduced

    def _consume(self, buckets: Sequence[FlatBucket]) -> None:
        for bucket in buckets:
            i = bucket.index
            flat = self.grads[i]
            if self._in_place[i] and flat is not None:
                bucket.shard_of(flat).zero_()
            self._in_place[i] = False
            self._reduced[i] = None

    def _zero_grad(self, buckets: Sequence[FlatBucket], set_to_none: bool) -> None:
        for bucket in buckets:
            i = bucket.index
            if set_to_none:  # Note [full gradients between steps]
                self.grads[i] = None
                self._in_place[i] = False
                self._reduced[i] = None
                for param in bucket.params:
                    param.grad = None
                continue
            flat = self.grads[i]
            # A reduced bucket's buffer is already zero but for this rank's reduced shard, which _consume zeroes.
            if flat is not None and self.state[i] is not BucketState.REDUCED:
                flat.zero_()
            self._consume([bucket])
            if flat is not None:
                for slot, param in bucket.slots_and_params():
                    param.grad = FlatBucket.param_view(flat, slot)

    def _has_local_gradients(self, bucket: FlatBucket) -> bool:
        return self.state[bucket.index] is BucketState.FILLING and self.grads[bucket.index] is not None

    def state_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)
