"""``TieredGradReducer``: stage 3's gradient shards written to the disk tier as their reduce-scatter completes.

Note [gradients on disk]
With the optimizer state on disk, a stage-3 rank would still hold its whole gradient shard (4Ψ/N bytes in fp32)
between backward and the step: for the model the disk tier exists for, more than the rest of the step's memory put
together. So a bucket's gradient shard gets memory only while its reduce-scatter is in flight, and is written to
the tier file when it completes (with ``grad_accumulation="sharded"`` a later micro-batch reads it back and adds to
it). The step then streams: bucket by bucket, the shard is read back with the bucket's masters and optimizer state
(read ahead, Note [read-ahead order]), stepped, and dropped without a write.

Clipping by the global norm needs every gradient before the first element is stepped. It is done in two phases:
backward writes the gradients; ``clip_grad_norm_`` reads each bucket's shard once to compute the partial norms (a
norm pass, one extra read of the gradient shards, only in steps that clip by norm) and keeps the clip coefficient;
the streaming step multiplies each shard by it as it is read. Clipping by value is applied the same way. The norm
pass costs the gradients' bytes once more, instead of keeping them in memory or writing them twice. Hooks that read
``master.grad`` before the step (``on_before_optimizer_step``) see no gradient for a bucket on disk.

fp16 loss scaling needs two things of every gradient before the first element is stepped: whether it is finite
(the step is skipped by every rank otherwise) and its unscaled value. The check is made as each shard's reduction
completes, while the shard is in memory anyway, and kept as a flag per bucket (``nonfinite``) that joins the
overflow vote of ``ZeroOptimizer.reduce_gradients``; no extra read. Unscaling is one more factor applied as the
step and the norm pass read the shards (``StateTiers.gradients_reduced``), in fp32, in the order the step without
tiers applies them (unscale, then clip), so the numbers are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.offload.tensor_swapper import TensorSwapper
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer


def grad_key(bucket: FlatBucket) -> tuple[str, int]:
    return ("grad", id(bucket))


class TieredGradReducer(ShardedGradReducer):
    """The stage-2/3 reducer with the gradient shards of ``on_disk`` buckets in ``swapper`` (Note [gradients on
    disk]); other buckets keep theirs in memory."""

    def __init__(
        self, *reducer_args: Any, swapper: TensorSwapper, on_disk: Callable[[FlatBucket], bool], **reducer_kwargs: Any
    ) -> None:
        """``reducer_args``/``reducer_kwargs``: ``GradientReducer``'s; ``on_disk``: whether a bucket's shard goes to
        ``swapper``'s tier file."""
        self.swapper = swapper
        self._on_disk = on_disk  # read by _init_storage, which the reducer's __init__ calls
        super().__init__(*reducer_args, **reducer_kwargs)
        self._tiered = [on_disk(b) for b in self.buckets]
        self.check_finite = False
        """Loss scaling: each tiered shard is checked for inf/NaN as its reduction completes (Note [gradients on
        disk])."""
        self._nonfinite: dict[tuple[int, int], Tensor] = {}
        """Per (bucket index, optimizer claiming part of it) reduced since that optimizer's gradients last restarted
        from zero: whether its elements of the shard hold inf/NaN (Note [gradients of several optimizers])."""

    def offloads(self, bucket: FlatBucket) -> bool:
        return self._tiered[bucket.index]

    def _new_shard(self, bucket: FlatBucket) -> Tensor | None:
        if not self._on_disk(bucket):
            return super()._new_shard(bucket)
        # Uninitialized and immediately freed: the shard's memory exists only while a reduction writes it.
        shard = torch.empty(bucket.shard_numel, dtype=self._reduce_dtype(bucket), device=bucket.device)
        shard.untyped_storage().resize_(0)
        self.swapper.add(grad_key(bucket), shard)
        return shard

    def _launch(self, bucket: FlatBucket) -> PendingCollective:
        if self._tiered[bucket.index]:
            # A first reduction overwrites the shard: nothing to read. A later one adds to what is on disk.
            self.swapper.acquire(grad_key(bucket), read=not self._shard_is_zero[bucket.index])
        return super()._launch(bucket)

    def _complete(self, bucket: FlatBucket) -> None:
        super()._complete(bucket)
        if self._tiered[bucket.index]:
            shard = self.shards[bucket.index]
            if self.check_finite and shard is not None:  # the accumulated shard: an earlier inf stays non-finite
                for owner, spans in self.owners.spans(bucket).items():
                    if not spans:
                        continue  # none of its elements on this rank
                    bad = torch.stack([torch.isfinite(shard[a:b]).logical_not().any() for a, b in spans]).any()
                    earlier = self._nonfinite.get((bucket.index, owner))
                    self._nonfinite[(bucket.index, owner)] = bad if earlier is None else earlier.logical_or(bad)
            self.swapper.release(grad_key(bucket), write=True)

    def nonfinite(self, buckets: Sequence[FlatBucket], owner: int) -> list[Tensor]:
        """For those of ``buckets`` reduced since ``owner``'s gradients restarted from zero: whether its elements of
        each one's tiered shard hold inf/NaN (0-d bools). Each optimizer asks about its own elements."""
        return [self._nonfinite[(b.index, owner)] for b in buckets if (b.index, owner) in self._nonfinite]

    def _consume(self, buckets: Sequence[FlatBucket]) -> None:
        self._forget_nonfinite(buckets, None)
        super()._consume(buckets)

    def _zero_grad(self, buckets: Sequence[FlatBucket], set_to_none: bool) -> None:
        super()._zero_grad(buckets, set_to_none)
        self._forget_nonfinite(buckets, None)

    def _zero_spans(self, bucket: FlatBucket, owner: int) -> None:
        self._forget_nonfinite([bucket], owner)
        if not self._tiered[bucket.index] or self._shard_is_zero[bucket.index] or self._has_local_gradients(bucket):
            super()._zero_spans(bucket, owner)
            return
        # On disk: zeros written over the spans, in the file (or in memory if resident), nothing read.
        shard = self.shards[bucket.index]
        assert shard is not None
        for start, stop in self.owners.spans(bucket)[owner]:
            zeros = torch.zeros(stop - start, dtype=shard.dtype, device=shard.device)
            self.swapper.write_range(grad_key(bucket), start * shard.element_size(), zeros)

    def _forget_nonfinite(self, buckets: Sequence[FlatBucket], owner: int | None) -> None:
        """``owner``'s flags (None: every optimizer's) of ``buckets``: its gradients there restart from zero."""
        indices = {b.index for b in buckets}
        for key in [k for k in self._nonfinite if k[0] in indices and owner in (None, k[1])]:
            del self._nonfinite[key]

    def load_grad(self, bucket: FlatBucket) -> Tensor:
        """The bucket's gradient shard, read back for the step or the norm pass; ``drop_grad`` when done."""
        return self.swapper.acquire(grad_key(bucket))

    def drop_grad(self, bucket: FlatBucket) -> None:
        self.swapper.release(grad_key(bucket), write=False)

    def state_bytes(self) -> int:
        return sum(s.untyped_storage().nbytes() for s in self.shards if s is not None)

    def disk_bytes(self) -> int:
        return sum(
            s.numel() * s.element_size() for s, t in zip(self.shards, self._tiered, strict=True) if t and s is not None
        )
