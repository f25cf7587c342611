"""``HostTier``: the optimizer's side of ZeRO-Offload's data path, for the buckets placed in the host tier.

Host masters, host gradients and the copies between them and the device shards, as Note [host tier data path] in
``host_copies.py`` describes; ``OptimizerTiers`` calls it around each bucket's step. Each bucket's host tensors
span the segments this optimizer steps (``lo``..``hi`` of the shard); copies to the device are made per run of
consecutive segments, so elements of other optimizers or of frozen parameters in the same bucket are never
written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_zero.offload.host_arena import HostArena, huge_pages
from lightning_zero.offload.host_copies import Copy, CopyStream
from lightning_zero.offload.tensor_swapper import TensorSwapper
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_reducer import GradientReducer
from lightning_zero.sharding.param_groups import Segment

_EDIT_CHUNK = 1 << 22
"""Elements of parameters read back per copy for the edit check (Note [edits reach the masters])."""


@dataclass(eq=False)
class _HostBucket:
    bucket: FlatBucket
    lo: int
    hi: int
    master: Tensor
    """(hi - lo,) host masters of the bucket's segments (fp32, or the parameter dtype without fp32 masters)."""
    runs: list[tuple[int, int]]
    """Consecutive segments ``[a, b)`` in shard coordinates: what is read and written on the device."""
    grad: Tensor | None = None
    """(hi - lo,) the reduced gradient, copied from the device (reduce dtype)."""
    pending: Copy | None = None
    fresh: bool = False
    """Whether ``grad`` (or the copy in flight) holds the gradient of the last reduction."""
    staging: Tensor | None = None
    """(hi - lo,) parameter-dtype host buffer the updated low-precision parameters are uploaded from: the gradient
    buffer's bytes (dead once the bucket is stepped) where they fit, else its own."""
    uploads: list[Copy] = field(default_factory=list)
    rounded: bool = False
    """Whether the worker rounds the masters into ``staging`` after this step's update (``rounding``)."""


class HostTier:
    """Host masters and gradients of one optimizer's host-tier buckets on ``device``; ``swapper`` is the host store
    holding stage-3 parameter shards (``offload_params="cpu"``), if any."""

    def __init__(self, device: torch.device, swapper: TensorSwapper | None) -> None:
        self.device = device
        self.swapper = swapper
        self.copies = CopyStream(device)
        self.arena = HostArena(device)
        """Every host buffer of the tier, at its exact size (Note [pinned bytes])."""
        self._buckets: dict[int, _HostBucket] = {}
        self._scratch: dict[torch.dtype, Tensor] = {}
        self._converted: dict[tuple[int, torch.dtype], Tensor] = {}
        self.scratch_bytes = 0
        """Bytes of the workers' buffers for converted gradients (``converted``): one largest bucket per worker,
        where the conversion before them allocated one per bucket stepped; not counted in ``nbytes``."""
        self.bytes_to_host = 0
        """Bytes copied from the device so far: gradients, and parameters read for edits."""
        self.bytes_to_device = 0
        """Bytes copied to the device so far: updated parameters."""

    def __contains__(self, bucket: FlatBucket) -> bool:
        return id(bucket) in self._buckets

    def reserve(self, spans: Sequence[tuple[FlatBucket, int]], fp32: bool) -> None:
        """Size the arena for these buckets' masters and gradients (``(bucket, elements)``; the gradient in the
        parameter dtype, as reduced unless ``reduce_dtype`` says otherwise)."""
        self.arena.reserve(
            [n * (4 if fp32 else b.dtype.itemsize) for b, n in spans] + [n * b.dtype.itemsize for b, n in spans]
        )

    def masters(self, segments: Sequence[Segment], fp32: bool) -> list[Tensor]:
        """Host masters for one bucket's segments, set from its parameter shard."""
        bucket = segments[0].bucket
        lo, hi = segments[0].start, segments[-1].stop
        master = self.arena.empty(hi - lo, torch.float32 if fp32 else bucket.dtype)
        runs: list[tuple[int, int]] = []
        for seg in segments:
            if runs and runs[-1][1] == seg.start:
                runs[-1] = (runs[-1][0], seg.stop)
            else:
                runs.append((seg.start, seg.stop))
        host = self._buckets[id(bucket)] = _HostBucket(bucket, lo, hi, master, runs)
        for a, b in runs:
            self._read_shard(host, a, b, master[a - lo : b - lo])
        return [master[seg.start - lo : seg.stop - lo] for seg in segments]

    # -- gradients down -----------------------------------------------------------------------------------------------
    def on_reduced(self, reducer: GradientReducer, bucket: FlatBucket) -> None:
        """A bucket's reduction completed: in the last backward before the step, copy its shard to the host now."""
        host = self._buckets.get(id(bucket))
        if host is None:
            return
        if reducer.require_sync:
            self._download(host, reducer)
        else:
            host.fresh = False  # an accumulating micro-batch: the final reduction (or the step) copies it

    def _download(self, host: _HostBucket, reducer: GradientReducer) -> None:
        shard = reducer.grad_shard(host.bucket)[host.lo : host.hi]
        if host.grad is None or host.grad.dtype != shard.dtype:
            host.grad = self.arena.empty(host.hi - host.lo, shard.dtype)
        host.pending = self.copies.copy(host.grad, shard)  # a later copy on the same stream lands after this one
        host.fresh = True
        self.bytes_to_host += shard.numel() * shard.element_size()

    def gradient(self, bucket: FlatBucket, reducer: GradientReducer) -> Tensor:
        """(hi - lo,) the bucket's reduced gradient in host memory, once its copy has landed."""
        host = self._buckets[id(bucket)]
        if not host.fresh:
            self._download(host, reducer)
        if host.pending is not None:
            host.pending.wait()
            host.pending = None
        assert host.grad is not None
        return host.grad

    def nonfinite(self, reducer: GradientReducer) -> list[Tensor]:
        """Per host-tier bucket, whether its reduced gradient holds inf/NaN (0-d bools), checked on the device shard
        the host copy was taken from: no wait for the copy, no host synchronization (loss scaling)."""
        flags = []
        for host in self._buckets.values():  # its own segments only: another optimizer's may lie between them
            shard = reducer.grad_shard(host.bucket)
            flags.append(torch.stack([torch.isfinite(shard[a:b]).logical_not().any() for a, b in host.runs]).any())
        return flags

    def offset(self, bucket: FlatBucket) -> int:
        """Where the bucket's host tensors start in shard coordinates."""
        return self._buckets[id(bucket)].lo

    # -- parameters: edits in, updates out ----------------------------------------------------------------------------
    def adopt_edits(self, bucket: FlatBucket) -> None:
        """The masters take the value of every parameter element edited since the last step (Note [edits reach the
        masters]): the parameters are read back from the device (or the host store) first. Called for a bucket
        ``ParamEdits`` found edited (every step, for a shard in the host store)."""
        host = self._buckets[id(bucket)]
        for a, b in host.runs:
            master = host.master[a - host.lo : b - host.lo]
            if master.dtype == bucket.dtype:
                self._read_shard(host, a, b, master)  # the parameter is the master's exact value
                continue
            for c in range(a, b, _EDIT_CHUNK):  # through a small buffer: the gradient buffer is still in use
                d = min(b, c + _EDIT_CHUNK)
                current = self._edit_scratch(bucket.dtype)[: d - c]
                self._read_shard(host, c, d, current)
                part = master[c - a : d - a]
                edited = current != part.to(current.dtype)
                if edited.any():  # host memory: no device wait. Edits are rare; the masters are then left alone
                    torch.where(edited, current, part, out=part)

    def rounding(self, bucket: FlatBucket) -> Callable[[], None] | None:
        """The rounding of the bucket's masters into its staging buffer, for the worker to run right after the
        bucket's update (Note [host step threads]); ``write_back`` then only uploads. None: the masters are in the
        parameter dtype (uploaded as they are)."""
        host = self._buckets[id(bucket)]
        if host.master.dtype == bucket.dtype:
            return None
        staging = self._staging(host)  # chosen here: the arena is the training thread's
        pairs = [(staging[a - host.lo : b - host.lo], host.master[a - host.lo : b - host.lo]) for a, b in host.runs]
        host.rounded = True

        def run() -> None:
            for values, master in pairs:
                values.copy_(master)

        return run

    def write_back(self, bucket: FlatBucket) -> None:
        """After the bucket's step: its masters (rounded to the parameter dtype, here unless the worker did:
        ``rounding``) into the parameter shard, on the device (the compute stream waits for the copy) or in the
        host store."""
        host = self._buckets[id(bucket)]
        for a, b in host.runs:
            master = host.master[a - host.lo : b - host.lo]
            values = master
            if master.dtype != bucket.dtype:
                values = self._staging(host)[a - host.lo : b - host.lo]
                if not host.rounded:
                    values.copy_(master)
            upload = self._write_shard(host, a, values)
            if upload is not None:
                host.uploads.append(upload)
        host.rounded = False

    def close(self) -> None:
        """Every copy is done and the host buffers are unpinned (the tier's end)."""
        self.copies.synchronize()
        self.arena.close()

    def end_step(self) -> None:
        """Every copy of the step has landed: the next step may rewrite the host buffers they read."""
        for host in self._buckets.values():
            if host.pending is not None:
                host.pending.wait()
                host.pending = None
            host.fresh = False
            for upload in host.uploads:
                upload.wait()
            host.uploads.clear()

    def nbytes(self) -> int:
        """Host bytes the allocator gave out for masters, gradients and staging buffers (Note [pinned bytes])."""
        return self.arena.reserved_bytes

    # -- the parameter shard, wherever it is --------------------------------------------------------------------------
    def _staging(self, host: _HostBucket) -> Tensor:
        """After the bucket's step: where its rounded masters are uploaded from."""
        numel, dtype = host.hi - host.lo, host.bucket.dtype
        grad = host.grad
        if grad is not None and grad.numel() * grad.element_size() >= numel * dtype.itemsize:
            return grad.view(torch.uint8)[: numel * dtype.itemsize].view(dtype)
        if host.staging is None:
            host.staging = self.arena.empty(numel, dtype)
        return host.staging

    def converted(self, slot: int, numel: int, dtype: torch.dtype) -> Tensor:
        """``numel`` elements of worker ``slot``'s buffer for a bucket's gradients converted to the masters'
        ``dtype`` (Note [host step threads]): one per worker, of the largest bucket's size, reused by every bucket
        that worker steps (the worker runs one update at a time)."""
        if (slot, dtype) not in self._converted:  # never copied to the device: not pinned, not in the arena
            largest = max(h.hi - h.lo for h in self._buckets.values())
            self._converted[slot, dtype] = torch.empty(largest, dtype=dtype)
            huge_pages(self._converted[slot, dtype])  # Note [huge pages]: before the first write
            self.scratch_bytes += largest * dtype.itemsize
        return self._converted[slot, dtype][:numel]

    def _edit_scratch(self, dtype: torch.dtype) -> Tensor:
        if dtype not in self._scratch:
            largest = max(h.hi - h.lo for h in self._buckets.values())
            self._scratch[dtype] = self.arena.empty(min(_EDIT_CHUNK, largest), dtype)
        return self._scratch[dtype]

    def held(self, bucket: FlatBucket) -> bool:
        """Whether the bucket's parameter shard lives in the host store between uses (not on the device)."""
        return self.swapper is not None and self.swapper.owner(bucket.param_shard) is not None

    def _read_shard(self, host: _HostBucket, a: int, b: int, out: Tensor) -> None:
        """``out`` (host) takes elements ``[a, b)`` of the bucket's parameter shard; waits for them."""
        shard = host.bucket.param_shard
        values = out if out.dtype == shard.dtype else torch.empty(b - a, dtype=shard.dtype)
        if self.held(host.bucket):
            assert self.swapper is not None
            key = self.swapper.owner(shard)
            self.swapper.read_range(key, a * shard.element_size(), values)
        else:
            self.copies.copy(values, shard[a:b]).wait()
            self.bytes_to_host += values.numel() * values.element_size()
        if values is not out:
            out.copy_(values)

    def _write_shard(self, host: _HostBucket, a: int, values: Tensor) -> Copy | None:
        """Elements ``[a, a + len(values))`` of the parameter shard take ``values`` (parameter dtype, host)."""
        shard = host.bucket.param_shard
        if self.held(host.bucket):
            assert self.swapper is not None
            self.swapper.write_range(self.swapper.owner(shard), a * shard.element_size(), values)
            return None
        upload = self.copies.copy(shard[a : a + values.numel()], values)
        self.bytes_to_device += values.numel() * values.element_size()
        upload.order_compute()  # the all-gather (or stage 3's next gather) reads the new values
        return upload
