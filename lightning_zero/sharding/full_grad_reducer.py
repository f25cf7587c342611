"""``FullGradReducer``: stage 1's gradient storage, full buffers reduced once per optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from lightning_zero.comm.collectives import PendingCollective, ProcessGroup
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.flat_bucket import FlatBucket, ParamSlot
from lightning_zero.sharding.gradient_reducer import BucketState, GradientReducer, accumulate_into


class FullGradReducer(GradientReducer):
    """Stage 1: persistent full gradient buffers, ``param.grad`` as views; reduced at the last backward or the step.

    Note [reduced shard in place]
    A reduction writes this rank's averaged shard into this rank's own slice of the bucket's gradient buffer (the
    collective allows that aliasing) and zeroes the rest, so the averaged gradient needs no memory of its own; the
    step reads it there and ``consume()`` zeroes the slice for the next backward. A second backward with sync on
    before the step (manual optimization) would accumulate into that slice: a hook that runs before each gradient
    is accumulated first moves the average out to a separate tensor, and later reductions add into that one, so
    several such backward passes add up, exactly like DDP's in-place all-reduce.
    """

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        group: ProcessGroup,
        config: ZeroConfig,
        ledger: CommLedger,
        on_complete: Callable[[FlatBucket], None] | None = None,
    ) -> None:
        self.grads = [torch.zeros(b.padded_numel, dtype=b.dtype, device=b.device) for b in buckets]
        """(padded_numel,) per bucket; parameters' ``.grad`` are views into it."""
        self._reduced: list[Tensor | None] = [None] * len(buckets)
        """(shard_numel,) per bucket once reduced in this step: the averaged gradient shard."""
        self._in_place = [False] * len(buckets)
        """Whether ``_reduced`` is this rank's slice of the gradient buffer: Note [reduced shard in place]."""
        super().__init__(buckets, group, config, ledger, on_complete)
        self._attach_grad_views()
        for bucket in self.buckets:
            for param in bucket.params:
                self._handles.append(param.register_hook(partial(self._before_accumulate, bucket)))

    def _before_accumulate(self, bucket: FlatBucket, grad: Tensor) -> None:
        self._move_out(bucket)

    def _move_out(self, bucket: FlatBucket) -> None:
        """Give a reduced shard held in place its own tensor, before the buffer takes new gradients."""
        if self._in_place[bucket.index]:  # Note [reduced shard in place]
            own = bucket.shard_of(self.grads[bucket.index])
            self._reduced[bucket.index] = own.clone()
            own.zero_()
            self._in_place[bucket.index] = False

    def _attach_grad_views(self) -> None:
        for bucket, flat in zip(self.buckets, self.grads, strict=True):
            for slot, param in bucket.slots_and_params():
                param.grad = FlatBucket.param_view(flat, slot)

    def _communicates_now(self) -> bool:
        return self.require_sync and self.config.overlap_comm

    def _store(self, bucket: FlatBucket, slot: ParamSlot, param: nn.Parameter) -> None:
        view = FlatBucket.param_view(self.grads[bucket.index], slot)
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            # Something replaced .grad (e.g. ``module.zero_grad(set_to_none=True)``): autograd then allocated a
            # fresh tensor holding this backward's gradient. Fold it back into the flat buffer.
            view.copy_(grad)
            param.grad = view

    def _launch(self, bucket: FlatBucket) -> PendingCollective:
        self._move_out(bucket)  # a second reduction in one step of a bucket that got no gradient in between
        flat = self.grads[bucket.index]
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

    def consume(self) -> None:
        for bucket, flat in zip(self.buckets, self.grads, strict=True):
            if self._in_place[bucket.index]:
                bucket.shard_of(flat).zero_()
        self._in_place = [False] * len(self.buckets)
        self._reduced = [None] * len(self.buckets)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The flat buffers stay allocated either way: they are autograd's accumulation target (``.grad`` views).
        self.wait()
        for bucket, flat in zip(self.buckets, self.grads, strict=True):
            if self.state[bucket.index] is not BucketState.REDUCED:  # a reduced bucket's buffer is already zero
                flat.zero_()
        self.consume()
        self.state = [BucketState.FILLING] * len(self.buckets)
        self._attach_grad_views()

    def state_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads)
