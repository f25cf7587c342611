"""``OptimizerTiers``: the masters and optimizer state of the tiered buckets, loaded around each bucket's step.

Implements the optimizer's ``StateTiers`` (Note [tiered step] in ``sharding/sharded_optimizer.py``). Per bucket it
knows the segments, their masters and the tensors those masters live in: a master run (mixed precision), or the
parameter shard itself (fp32 at stage 3, in the parameter tier when ``offload_params="disk"``; at stages 1 and 2 the
fp32 shard is a view of the full parameters, which stay in memory). The optimizer's per-element state (Adam's
moments: every state tensor with the master's shape) is created by the user's optimizer in the first step, in memory,
bucket by bucket, and goes to the tier as soon as that bucket is stepped; 0-d entries (a step count) stay in memory.

Note [host tier on this machine]
``"cpu"`` keeps masters and optimizer state in host memory. On a CPU device that is where they are already: the
tier moves nothing and the step is the normal one. On a GPU the same placement needs pinned host masters, gradient
shards copied device-to-host on a side stream as their reduce-scatter completes, the step on the host, and the
updated shards copied back before the all-gather; that data path is not implemented yet, so ``"cpu"`` on a non-CPU
device is refused at setup rather than silently left on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero.offload.tensor_swapper import TensorSwapper
from lightning_zero.offload.tiered_grad_reducer import TieredGradReducer
from lightning_zero.sharding.flat_bucket import FlatBucket

if TYPE_CHECKING:
    from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


def param_key(bucket: FlatBucket) -> tuple[str, int]:
    return ("param", id(bucket))


def _state_key(optimizer: ZeroOptimizer, segment: int, name: str) -> Hashable:
    return ("state", id(optimizer), segment, name)


class _Chunk:
    """One tiered bucket's segments (indices into the optimizer's lists) and the tier keys loaded with it."""

    def __init__(self, segments: list[int]) -> None:
        self.segments = segments
        self.loaded: list[Hashable] = []
        self.grad_loaded = False


class OptimizerTiers:
    """Loads and unloads the tiered buckets of one ``ZeroOptimizer`` (``on_disk``: the buckets placed in the disk
    tier by ``offload_ratio``; the others stay in memory)."""

    def __init__(self, swapper: TensorSwapper | None, place: Callable[[list[FlatBucket]], set[int]]) -> None:
        self.swapper = swapper
        self._place = place
        self.on_disk: set[int] = set()
        """ids of the buckets whose masters and optimizer state are on disk (placed at ``attach``)."""
        self._optimizer: ZeroOptimizer | None = None
        self._chunks: dict[int, _Chunk] = {}
        self._coefficient: Tensor | None = None
        self._clamp: float | None = None

    @property
    def _opt(self) -> ZeroOptimizer:
        assert self._optimizer is not None, "OptimizerTiers.attach() was not called"
        return self._optimizer

    def _reducer(self) -> TieredGradReducer | None:
        reducer = self._opt.reducer
        return reducer if isinstance(reducer, TieredGradReducer) else None

    # -- StateTiers ---------------------------------------------------------------------------------------------------
    def attach(self, optimizer: ZeroOptimizer) -> None:
        self._optimizer = optimizer
        self.on_disk = self._place(optimizer.buckets) if self.swapper is not None else set()
        for i, seg in enumerate(optimizer.segments):
            self._chunks.setdefault(id(seg.bucket), _Chunk([])).segments.append(i)
        if self.swapper is None:
            return
        for run in optimizer.master_runs:
            if id(run.bucket) in self.on_disk:
                self.swapper.add(("master", id(run.bucket), run.start), run.master)
        self.swapper.evict_all()

    @contextmanager
    def resident(self, bucket: FlatBucket) -> Iterator[None]:
        key = param_key(bucket)
        if self.swapper is None or key not in self.swapper:
            yield
            return
        self.swapper.acquire(key)
        try:
            yield
        finally:
            self.swapper.release(key)

    def holds_gradient(self, bucket: FlatBucket) -> bool:
        reducer = self._reducer()
        return reducer is not None and reducer.offloads(bucket)

    def gradient_norms(self, norm_type: float) -> list[Tensor]:
        reducer = self._reducer()
        if reducer is None:
            return []
        opt = self._opt
        norms: list[Tensor] = []
        for bucket in opt.buckets:
            chunk = self._chunks.get(id(bucket))
            if chunk is None or not reducer.offloads(bucket):
                continue
            used = [i for i in chunk.segments if opt.segment_used[i]]
            if not used:
                continue
            shard = reducer.load_grad(bucket)
            pieces = [shard[opt.segments[i].start : opt.segments[i].stop] for i in used]
            if norm_type == float("inf"):
                norms.extend(p.abs().max().float() for p in pieces)
            else:
                norms.extend(torch._foreach_norm(pieces, norm_type, dtype=torch.float32))
            reducer.drop_grad(bucket)
        return norms

    def set_gradient_transform(self, coefficient: Tensor | None, clamp: float | None) -> None:
        self._coefficient = coefficient
        self._clamp = clamp

    def load(self, bucket: FlatBucket) -> None:
        chunk = self._chunks.get(id(bucket))
        if chunk is None or self.swapper is None:
            return
        opt = self._opt
        keys: list[Hashable] = [param_key(bucket)] if param_key(bucket) in self.swapper else []
        if id(bucket) in self.on_disk:
            keys += [k for k in self._master_keys(bucket) if k in self.swapper]
            keys += [k for k, t in self._state_tensors(chunk) if k in self.swapper and self.swapper.tensor(k) is t]
        for key in keys:
            self.swapper.acquire(key)
        chunk.loaded = keys
        reducer = self._reducer()
        if reducer is not None and reducer.offloads(bucket):
            shard = reducer.load_grad(bucket)
            chunk.grad_loaded = True
            if self._coefficient is not None:
                shard.mul_(self._coefficient.to(shard.dtype))
            if self._clamp is not None:
                shard.clamp_(-self._clamp, self._clamp)
            for i in chunk.segments:
                seg, master = opt.segments[i], opt.masters[i]
                grad = shard[seg.start : seg.stop]
                if opt.segment_used[i]:
                    master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def unload(self, bucket: FlatBucket) -> None:
        chunk = self._chunks.get(id(bucket))
        if chunk is None or self.swapper is None:
            return
        opt = self._opt
        for key in chunk.loaded:
            self.swapper.release(key)
        chunk.loaded = []
        for key, tensor in self._state_tensors(chunk) if id(bucket) in self.on_disk else []:
            if key not in self.swapper or self.swapper.tensor(key) is not tensor:
                self.swapper.add(key, tensor)  # created by this step (or by a checkpoint load): Note [tiered step]
                self.swapper.acquire(key, read=False)
                self.swapper.release(key)
        if chunk.grad_loaded:
            for i in chunk.segments:
                opt.masters[i].grad = None
            reducer = self._reducer()
            assert reducer is not None
            reducer.drop_grad(bucket)
            chunk.grad_loaded = False

    def end_step(self) -> None:
        if self.swapper is not None:
            self.swapper.end_step()

    def new_state(self, master: Tensor, name: str) -> Tensor | None:
        if self.swapper is None:
            return None
        opt = self._opt
        i = next(k for k, m in enumerate(opt.masters) if m is master)
        if id(opt.segments[i].bucket) not in self.on_disk:
            return None
        state = torch.empty(master.shape, dtype=master.dtype, device=master.device)
        state.untyped_storage().resize_(0)  # no memory: a checkpoint load writes it in the tier file
        self.swapper.add(_state_key(opt, i, name), state)
        return state

    # -- outside the step ---------------------------------------------------------------------------------------------
    def load_all(self) -> None:
        """Every tiered bucket resident (a checkpoint save or load reads or writes all of this rank's state)."""
        for bucket in self._opt.buckets:
            self.load(bucket)

    def unload_all(self) -> None:
        for bucket in self._opt.buckets:
            self.unload(bucket)

    def discard(self) -> None:
        """Forget the tiered buckets' optimizer state (its files are being removed)."""
        if self._optimizer is None:
            return
        opt = self._opt
        for bucket_id, chunk in self._chunks.items():
            if bucket_id in self.on_disk:
                for i in chunk.segments:
                    opt.optimizer.state.pop(opt.masters[i], None)

    def _master_keys(self, bucket: FlatBucket) -> list[Hashable]:
        return [("master", id(r.bucket), r.start) for r in self._opt.master_runs if r.bucket is bucket]

    def _state_tensors(self, chunk: _Chunk) -> list[tuple[Hashable, Tensor]]:
        opt = self._opt
        found: list[tuple[Hashable, Tensor]] = []
        for i in chunk.segments:
            master = opt.masters[i]
            for name, value in opt.optimizer.state.get(master, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == master.numel():
                    found.append((_state_key(opt, i, name), value))
        return found
