"""``TieredGradients``: the gradients of the tiered buckets, as the step and the norm pass read them from their tier.

A bucket's reduced gradient shard is in the host tier's host buffer (``HostTier``) or, at stage 3 with the disk
tier, in the tier file (``TieredGradReducer``, Note [gradients on disk]); it never becomes ``master.grad`` outside
the step (Note [tiered step]). What the step without tiers does to ``master.grad`` in between, these do as the
gradient is read: the overflow check and unscaling of loss scaling (``reduced``), then every clip of the step
(``norms``, then ``transform``) in the order they were called, each on the values the clips before it left, in the
masters' dtype, so the numbers are the same (Note [clips in order]).

Note [clips in order]
A loop may clip twice before a step (a hook's ``clip_grad_norm_`` and then the Trainer's ``gradient_clip_val``, or
a norm and then a value). Without tiers each clip rewrites ``master.grad`` in place, so the second one measures
and scales what the first left. A tiered gradient is not rewritten until the step reads it, so the clips are kept
as a list of operations (a scale by a clip coefficient, a clamp) applied in the order they were called: to the
values a later clip measures (``norms``), to what ``.grad`` shows (``as_read``) and to what the step reads
(``set_on_masters``). Applying them one by one, not folded into one coefficient, keeps the rounding of the step
without tiers, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero.offload.host_tier import HostTier
from lightning_zero.offload.tiered_grad_reducer import TieredGradReducer
from lightning_zero.sharding.flat_bucket import FlatBucket

if TYPE_CHECKING:
    from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


class TieredGradients:
    """The tiered gradients of one ``ZeroOptimizer``: in ``host`` (the host tier) or its disk-tier reducer."""

    def __init__(self, host: HostTier | None) -> None:
        self.host = host
        self._optimizer: ZeroOptimizer | None = None
        self._clips: list[Tensor | float] = []
        """This step's clips in the order they were called (Note [clips in order]): a tensor is a clip coefficient
        to scale by, a float a value to clamp to."""
        self._coefficients: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}
        self._unscale: float | None = None

    def attach(self, optimizer: ZeroOptimizer) -> None:
        self._optimizer = optimizer

    @property
    def _opt(self) -> ZeroOptimizer:
        assert self._optimizer is not None, "TieredGradients.attach() was not called"
        return self._optimizer

    def reducer(self) -> TieredGradReducer | None:
        reducer = self._opt.reducer
        return reducer if isinstance(reducer, TieredGradReducer) else None

    def holds(self, bucket: FlatBucket) -> bool:
        """Whether the bucket's reduced gradient shard is in a tier."""
        if self.host is not None and bucket in self.host:
            return True
        reducer = self.reducer()
        return reducer is not None and reducer.offloads(bucket)

    def shard(self, bucket: FlatBucket) -> tuple[Tensor, int]:
        """The bucket's gradient shard from its tier, and the shard element it starts at."""
        if self.host is not None and bucket in self.host:
            return self.host.gradient(bucket, self._opt.reducer), self.host.offset(bucket)
        reducer = self.reducer()
        assert reducer is not None
        return reducer.load_grad(bucket), 0

    def drop(self, bucket: FlatBucket) -> None:
        """A shard read from the disk tier is no longer needed (the host tier's stays in its buffer)."""
        if self.host is None or bucket not in self.host:
            reducer = self.reducer()
            assert reducer is not None
            reducer.drop_grad(bucket)

    def on_device(self, bucket: FlatBucket) -> bool:
        """Whether the bucket's reduced gradient shard also stays in the device's memory until the step: the host
        tier's, which it copies from (Note [host tier data path]); ``.grad`` shows it from there (Note [gradients
        visible to hooks] in ``engine/sharded_gradient.py``)."""
        return self.host is not None and bucket in self.host

    def as_read(self, values: Tensor, dtype: torch.dtype) -> Tensor:
        """``values`` (elements of a tiered gradient shard) as the step will read them: in ``dtype``, unscaled and
        clipped as ``set_on_masters`` does; to be read only (``values`` itself where nothing changes them)."""
        if self._unscale is None and not self._clips:
            return values.to(dtype)
        out = values.to(dtype, copy=True)
        if self._unscale is not None:
            out.mul_(self._unscale)
        self._apply_clips([out])
        return out

    def _converted(self, device: torch.device, dtype: torch.dtype) -> list[Tensor | float]:
        """This step's clips with their coefficients on ``device`` in ``dtype``: one copy per step (a device scalar
        read on the host waits for the device)."""
        clips: list[Tensor | float] = []
        for i, clip in enumerate(self._clips):
            if isinstance(clip, Tensor):
                key = (i, device, dtype)
                if key not in self._coefficients:
                    self._coefficients[key] = clip.to(device=device, dtype=dtype)
                clip = self._coefficients[key]
            clips.append(clip)
        return clips

    def _apply_clips(self, grads: list[Tensor]) -> None:
        """``grads`` (one device and dtype) clipped in place by this step's clips, in order."""
        if grads:
            _clip_(grads, self._converted(grads[0].device, grads[0].dtype))

    def norms(self, segments_of: dict[int, list[int]], norm_type: float) -> list[Tensor]:
        """Per used segment of a bucket whose gradient is in a tier (``segments_of``: bucket id -> its segment
        indices): its gradient's norm (fp32, on the bucket's device), as the step will see it."""
        opt = self._opt
        norms: list[Tensor] = []
        for bucket in opt.buckets:
            used = [i for i in segments_of.get(id(bucket), []) if opt.segment_used[i]]
            if not used or not self.holds(bucket):
                continue
            if self.host is not None and bucket in self.host:
                # The device shard the host copy is taken from (the same values): no wait for the copy, and on a
                # GPU no pass over host memory on the training thread (Note [host step threads]).
                shard, first = opt.reducer.grad_shard(bucket), 0
            else:
                shard, first = self.shard(bucket)
            pieces = [shard[opt.segments[i].start - first : opt.segments[i].stop - first] for i in used]
            if self._unscale is not None or self._clips:  # the values the step will see, after the clips so far
                pieces = [self.as_read(p, opt.masters[i].dtype) for p, i in zip(pieces, used, strict=True)]
            if norm_type == float("inf"):
                found = [p.abs().max().float() for p in pieces]
            else:
                found = list(torch._foreach_norm(pieces, norm_type, dtype=torch.float32))
            norms.extend(n.to(bucket.device) for n in found)  # summed with the device's own: Note [tiered step]
            self.drop(bucket)
        return norms

    def reduced(self, found: Tensor, inv_scale: float | None) -> None:
        """The step's gradients are reduced: unscale by ``inv_scale`` as they are read, and add the tiered
        gradients' overflow flags to ``found``."""
        self._unscale = inv_scale
        self._clips = []
        self._coefficients.clear()
        if inv_scale is None:
            return
        flags = [] if self.host is None else self.host.nonfinite(self._opt.reducer)
        reducer = self.reducer()
        flags += reducer.nonfinite(self._opt.buckets, self._opt.gradient_owner) if reducer is not None else []
        for bad in flags:
            found.add_(bad.to(found.device))

    def transform(self, coefficient: Tensor | None, clamp: float | None) -> None:
        """Scale (clip by norm) or clamp (clip by value) the gradients as the step reads them, after the clips
        already taken this step (Note [clips in order])."""
        if coefficient is not None:
            self._clips.append(coefficient)
        if clamp is not None:
            self._clips.append(float(clamp))

    def end_step(self) -> None:
        self._unscale = None

    def set_on_masters(
        self,
        segments: list[int],
        shard: Tensor,
        first: int,
        scratch: Callable[[int, torch.dtype], Tensor] | None = None,
    ) -> Callable[[], None] | None:
        """The tiered gradient ``shard`` (from shard element ``first``), unscaled and clipped, as the ``.grad`` of
        the used masters of ``segments``. With ``scratch`` (the bucket's update runs on a worker: Note [host step
        threads]) the ``.grad`` are set now, as views of ``scratch(numel, dtype)`` where the gradient needs
        converting, and the per-element work (conversion, unscaling, clipping) is left to the function returned,
        which the worker runs right before the update."""
        opt = self._opt
        used = [i for i in segments if opt.segment_used[i]]
        dtypes = {opt.masters[i].dtype for i in used}
        source: Tensor | None = None
        if len(dtypes) == 1 and shard.dtype not in dtypes:
            # One conversion of the bucket's span rather than one tensor per segment: the masters' gradients stay
            # back to back, for one kernel call (Note [one kernel call per bucket] in ``host_adam.py``).
            lo = min(opt.segments[i].start for i in used) - first
            hi = max(opt.segments[i].stop for i in used) - first
            dtype = dtypes.pop()
            if scratch is None:
                shard = shard[lo:hi].to(dtype)
            else:  # converted by the worker into its own buffer: no allocation, off the training thread
                source, shard = shard[lo:hi], scratch(hi - lo, dtype)
            first += lo
        grads: list[Tensor] = []
        for i in used:
            seg, master = opt.segments[i], opt.masters[i]
            grad = shard[seg.start - first : seg.stop - first]
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
            grads.append(master.grad)
        # As of this step (a delayed update runs after its end), converted now on the training thread.
        clips = self._converted(grads[0].device, grads[0].dtype) if grads else []
        unscale = self._unscale

        def fill() -> None:
            if source is not None:
                shard.copy_(source)
            # In the masters' dtype, as the step without tiers unscales and clips them (ZeroOptimizer.
            # reduce_gradients, clip_grad_*), in that order.
            if unscale is not None:
                torch._foreach_mul_(grads, unscale)
            _clip_(grads, clips)

        if not grads or (source is None and unscale is None and not clips):
            return None
        if scratch is None:
            fill()
            return None
        return fill


def _clip_(grads: list[Tensor], clips: list[Tensor | float]) -> None:
    """Each clip in order (Note [clips in order]): a tensor scales by that coefficient, a float clamps to it."""
    for clip in clips:
        if isinstance(clip, float):
            torch._foreach_clamp_min_(grads, -clip)
            torch._foreach_clamp_max_(grads, clip)
        else:
            torch._foreach_mul_(grads, clip)
