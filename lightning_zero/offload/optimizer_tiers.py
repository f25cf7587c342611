"""``OptimizerTiers``: the masters and optimizer state of the tiered buckets, loaded around each bucket's step.

Implements the optimizer's ``StateTiers`` (Note [tiered step] in ``sharding/state_tiers.py``). It places the
buckets (``offload_ratio``) when the optimizer builds its masters. Per disk bucket it knows the segments, their
masters and the tensors those masters live in: a master run (mixed precision), or the parameter shard itself (fp32
at stage 3, in the parameter tier when ``offload_params="disk"``; at stages 1 and 2 the fp32 shard is a view of the
full parameters, which stay in memory). The optimizer's per-element state (Adam's moments: every state tensor with
the master's shape) is created by the user's optimizer in the first step, in memory, bucket by bucket, and goes to
the tier as soon as that bucket is stepped; 0-d entries (a step count) stay in memory.

Note [host tier on this machine]
``"cpu"`` keeps masters and optimizer state in host memory. On a CPU device that is where they are already: the
tier moves nothing and the step is the normal one. On a GPU (or on the CPU with ``host_copies.FORCE_COPIES``, as the
tests run it) the host-tier buckets take the data path of Note [host tier data path] (``HostTier``): host masters,
gradients copied from the device as their reduction completes, the step on the host, updated shards copied back.

The kernels the tiers step with: Note [tier step kernels] in ``host_adam.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from lightning_zero.offload.host_adam import MOMENT_NAMES, HostAdam, choose_step_kernels
from lightning_zero.offload.host_arena import huge_pages
from lightning_zero.offload.host_moments import DiskMoments
from lightning_zero.offload.host_steps import HostSteps, chained
from lightning_zero.offload.host_tier import HostTier
from lightning_zero.offload.tensor_swapper import TensorSwapper
from lightning_zero.offload.tiered_gradients import TieredGradients
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_groups import MasterRun, Segment, masters_for
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer
from lightning_zero.sharding.state_tiers import TierStep

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
        self.fill: Callable[[], None] | None = None
        """The worker's per-element work on the loaded gradients (``TieredGradients.set_on_masters``)."""
        self.stepping = False
        """Whether ``loaded`` was loaded for the step (Note [tier step kernels]: what it changes is marked)."""


class OptimizerTiers:
    """Loads and unloads the tiered buckets of one ``ZeroOptimizer``: those ``place`` puts in the optimizer's tier
    (``offload_ratio``) go to the disk (``swapper``) or, with ``host``, take the host tier's data path; the others
    stay in memory. ``swapper`` also holds stage-3 parameter shards of ``offload_params``."""

    def __init__(
        self,
        swapper: TensorSwapper | None,
        place: Callable[[list[FlatBucket]], set[int]],
        host: HostTier | None = None,
        steps_tiers: bool = False,
        host_steps: HostSteps | None = None,
        moments: DiskMoments | None = None,
    ) -> None:
        self.swapper = swapper
        self.moments = moments
        """The moments of the buckets ``HostAdam`` steps, on disk (Note [moments on disk]); None: in memory."""
        self.steps_tiers = steps_tiers
        """Whether the optimizer's tier is on (``offload_optimizer``): its step takes the kernels of Note [tier step
        kernels] even where the tier moves nothing (the host tier on a CPU device)."""
        self._place = place
        self.host = host
        self.host_steps = host_steps
        """Runs the updates of the buckets ``HostAdam`` covers (Note [host step threads]); None: the optimizer's."""
        self._adam: HostAdam | None = None
        self._own: set[int] = set()
        """ids of the buckets stepped by ``HostAdam`` (Note [bucketed host Adam])."""
        self.placed: set[int] = set()
        self.on_disk: set[int] = set()
        """ids of the buckets whose masters and optimizer state are on disk (placed in ``masters_for``)."""
        self._in_step = False
        self._optimizer: ZeroOptimizer | None = None
        self._chunks: dict[int, _Chunk] = {}
        self.gradients = TieredGradients(host)
        """The tiered buckets' gradients as the step reads them (unscaled, clipped)."""

    @property
    def _opt(self) -> ZeroOptimizer:
        assert self._optimizer is not None, "OptimizerTiers.attach() was not called"
        return self._optimizer

    # -- StateTiers ---------------------------------------------------------------------------------------------------
    def masters_for(
        self, buckets: Sequence[FlatBucket], segments: Sequence[Segment], fp32: bool
    ) -> tuple[list[Tensor], list[MasterRun]]:
        placed = self.placed = self._place(list(buckets))
        if self.host is None and self.swapper is not None:
            self.on_disk = placed
        masters: list[Tensor] = []
        runs: list[MasterRun] = []
        if self.host is not None:
            spans = [(b, sum(s.stop - s.start for s in segments if s.bucket is b)) for b in buckets if id(b) in placed]
            self.host.reserve([(b, n) for b, n in spans if n], fp32)
        for bucket in buckets:  # one bucket at a time: a tier keeps only that one's shard in memory
            mine = [s for s in segments if s.bucket is bucket]
            if not mine:
                continue
            if self.host is not None and id(bucket) in placed:
                masters += self.host.masters(mine, fp32)  # no runs: the host tier copies them (Note [tiered step])
                continue
            with self.resident(bucket):
                bucket_masters, bucket_runs = masters_for(mine, fp32)
            masters += bucket_masters
            runs += bucket_runs
        return masters, runs

    def attach(self, optimizer: ZeroOptimizer) -> None:
        self._optimizer = optimizer
        self.gradients.attach(optimizer)
        for i, seg in enumerate(optimizer.segments):
            self._chunks.setdefault(id(seg.bucket), _Chunk([])).segments.append(i)
        reducer = self.gradients.reducer()
        if reducer is not None and optimizer.loss_scaler is not None:
            reducer.check_finite = True  # Note [gradients on disk]
        if self.host is not None:
            optimizer.reducer.reduced_hooks.append(self._on_reduced)
        for bucket in optimizer.buckets:  # Note [edits reach the masters]: the shards written from host masters
            if self.host is not None and bucket in self.host:
                optimizer.edits.watch(bucket, digestible=not self.host.held(bucket))
            elif any(r.bucket is bucket for r in optimizer.master_runs) and (
                id(bucket) in self.on_disk or (self.swapper is not None and param_key(bucket) in self.swapper)
            ):  # masters on disk: digested, or compared every step where the shard is in a tier too
                held = self.swapper is not None and param_key(bucket) in self.swapper
                optimizer.edits.watch(bucket, digestible=not held)
        if self.host is not None or self.steps_tiers:
            choose_step_kernels(optimizer.optimizer, multi_tensor=self.host is not None)
        if self.host_steps is not None:
            self._adopt_host_adam(optimizer)
        if self.swapper is None:
            return
        for run in optimizer.master_runs:
            if id(run.bucket) in self.on_disk:
                self.swapper.add(("master", id(run.bucket), run.start), run.master)
        self.swapper.evict_all()

    def _adopt_host_adam(self, optimizer: ZeroOptimizer) -> None:
        """The buckets of the host tier (every bucket on a CPU device) all of whose param groups ``HostAdam`` covers,
        decided from what every rank shares (the bucket's parameters, not this rank's segments of it): a bucket
        stepped here is published at another point of the step, and its all-gather must be issued in the same
        order on every rank."""
        adam = HostAdam(optimizer.optimizer)
        group_of = {id(p): g for g, view in enumerate(optimizer.param_groups) for p in view["params"]}
        for bucket in optimizer.buckets:
            in_host = id(bucket) in self.placed if self.host is not None else id(bucket) not in self.on_disk
            groups = {group_of[id(p)] for p in bucket.params if id(p) in group_of}
            if not in_host or not adam.covers(sorted(groups)):
                continue
            chunk = self._chunks.get(id(bucket))
            segments = [optimizer.segments[i] for i in chunk.segments] if chunk is not None else []
            indices = chunk.segments if chunk is not None else []
            adam.add_bucket(id(bucket), indices, [s.start for s in segments], [s.stop for s in segments])
            self._own.add(id(bucket))
        self._adam = adam if self._own else None
        if self._own and isinstance(optimizer.reducer, ShardedGradReducer):
            optimizer.reducer.advise_shard = huge_pages  # a CPU device's gradient shards: Note [huge pages]
        if self.moments is None:
            return
        adam.allocate = self.moments.allocate
        stepped = [b for b in optimizer.buckets if self.host is None or id(b) in self.placed]
        if any(id(b) not in self._own for b in stepped):
            kinds = ", ".join(f"{k}: fused={g.get('fused')!r}" for k, g in enumerate(optimizer.optimizer.param_groups))
            raise ValueError(
                f"ZeroConfig.offload_optimizer_state='disk' with {type(optimizer.optimizer).__name__} ({kinds}): "
                "only torch's Adam and AdamW stepped by the host tier's fused kernels keep their moments on disk "
                "(Note [moments on disk]). HINT: use torch.optim.AdamW or Adam and leave `fused`/`foreach` unset, "
                "or offload_optimizer_state='with_masters'."
            )

    def _on_reduced(self, bucket: FlatBucket) -> None:
        assert self.host is not None
        if self.host_steps is not None and id(bucket) in self.host_steps.in_flight():
            return  # still read by the deferred update: copied at the step (Note [delayed parameter update])
        self.host.on_reduced(self._opt.reducer, bucket)

    def start_step(self, bucket: FlatBucket) -> TierStep:
        if self._adam is None or self.host_steps is None or id(bucket) not in self._own:
            return TierStep.GENERIC
        opt = self._opt
        update = self._adam.prepare(id(bucket), opt.masters, [s.group for s in opt.segments])
        chunk = self._chunks.get(id(bucket), _Chunk([]))
        if update is not None and self.host is not None and bucket in self.host:  # Note [host step threads]
            update = chained(chunk.fill, update, self.host.rounding(bucket))
        chunk.fill = None
        return self.host_steps.start(id(bucket), update)

    def finish_step(self, bucket: FlatBucket) -> None:
        if self.host_steps is not None:
            self.host_steps.finish(id(bucket))

    def in_flight(self) -> set[int]:
        return self.host_steps.in_flight() if self.host_steps is not None else set()

    def _join(self) -> None:
        """No update still writes masters or moments (Note [delayed parameter update])."""
        if self.host_steps is not None:
            self.host_steps.join()

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
        return self.gradients.holds(bucket)

    def gradient_norms(self, norm_type: float) -> list[Tensor]:
        self._join()  # a deferred update still reads the host gradients the norm pass would copy over
        return self.gradients.norms({k: c.segments for k, c in self._chunks.items()}, norm_type)

    def gradients_reduced(self, found: Tensor, inv_scale: float | None) -> None:
        self.gradients.reduced(found, inv_scale)
        self._in_step = True  # called as the step's gradients are reduced

    def set_gradient_transform(self, coefficient: Tensor | None, clamp: float | None) -> None:
        self.gradients.transform(coefficient, clamp)
        self._in_step = True

    def load(self, bucket: FlatBucket, only: Collection[str] | None = None) -> None:
        chunk = self._chunks.get(id(bucket))
        step = self._in_step and only is None
        if not step:
            self._join()  # an update of the masters' own state outside the step: Note [delayed parameter update]
        if self.moments is not None and (only is None or any(n in only for n in MOMENT_NAMES)):
            self.moments.load(id(bucket), in_order=step)
        if chunk is not None and self.host is not None and bucket in self.host:
            if step:  # outside a step (an EMA update) the host masters are all there is to load
                if self._opt.edits.edited(bucket):
                    self.host.adopt_edits(bucket)
                slot = self.host_steps.slot() if self.host_steps is not None and id(bucket) in self._own else None
                scratch = None if slot is None else partial(self.host.converted, slot)  # Note [host step threads]
                chunk.fill = self.gradients.set_on_masters(chunk.segments, *self.gradients.shard(bucket), scratch)
                chunk.grad_loaded = True
            return
        if chunk is None or self.swapper is None:
            return
        masters = self._master_keys(bucket)
        # The parameter shard: the step rounds the masters into it; otherwise only needed when it is the masters.
        keys: list[Hashable] = []
        if param_key(bucket) in self.swapper and (only is None or not masters):
            keys.append(param_key(bucket))
        if id(bucket) in self.on_disk:
            keys += [k for k in masters if k in self.swapper]
            keys += [
                k for k, t in self._state_tensors(chunk, only) if k in self.swapper and self.swapper.tensor(k) is t
            ]
        for key in keys:
            self.swapper.acquire(key, in_order=step)  # Note [read-ahead order]: the step's order only
        chunk.loaded = keys
        chunk.stepping = step
        reducer = self.gradients.reducer()
        if step and reducer is not None and reducer.offloads(bucket):
            self.gradients.set_on_masters(chunk.segments, reducer.load_grad(bucket), 0)
            chunk.grad_loaded = True

    def unload(self, bucket: FlatBucket) -> None:
        chunk = self._chunks.get(id(bucket))
        if self.moments is not None:
            self.moments.unload(id(bucket), stepped=self._in_step)
        if chunk is not None and self.host is not None and bucket in self.host:
            if chunk.grad_loaded:
                for i in chunk.segments:
                    self._opt.masters[i].grad = None
                chunk.grad_loaded = False
                self.host.write_back(bucket)  # stepped: the new values go to the parameter shard
            return
        if chunk is None or self.swapper is None:
            return
        opt = self._opt
        if chunk.stepping:
            self._mark_stepped(chunk)
            chunk.stepping = False
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
            self.gradients.drop(bucket)
            chunk.grad_loaded = False

    def _mark_stepped(self, chunk: _Chunk) -> None:
        """Bump the version counters of what a fused step changed in the chunk (Note [tier step kernels]), so that
        the swapper writes them back (Note [swap lifecycle])."""
        opt = self._opt
        groups = opt.optimizer.param_groups
        changed: list[Tensor] = []
        for i in chunk.segments:
            if not opt.segment_used[i] or not groups[opt.segments[i].group].get("fused"):
                continue
            master = opt.masters[i]
            changed.append(master)  # a view of the parameter shard, when that is the master: one counter
            changed += [v for v in opt.optimizer.state.get(master, {}).values() if isinstance(v, Tensor) and v.dim()]
        if changed:
            increment_version(changed)

    def end_step(self) -> None:
        self._in_step = False
        self.gradients.end_step()
        if self.host is not None:
            self.host.end_step()
        if self.swapper is not None:
            self.swapper.end_step()
        if self.moments is not None:
            self.moments.end_step()

    def new_state(self, master: Tensor, name: str) -> Tensor | None:
        opt = self._opt
        i = next(k for k, m in enumerate(opt.masters) if m is master)
        owner = self._adam.owner(i) if self._adam is not None and self.moments is not None else None
        if owner is not None and self.moments is not None and self._adam is not None:
            view = self._adam.state_view(owner, i, name, opt.masters)  # Note [moments on disk]
            self.moments.unload(owner, stepped=False)  # a new flat: written (zeros), freed; the load fills the file
            return view
        if self.swapper is None:
            return None
        if id(opt.segments[i].bucket) not in self.on_disk:
            return None
        state = torch.empty(master.shape, dtype=master.dtype, device=master.device)
        state.untyped_storage().resize_(0)  # no memory: a checkpoint load writes it in the tier file
        self.swapper.add(_state_key(opt, i, name), state)
        return state

    # -- outside the step ---------------------------------------------------------------------------------------------
    def load_all(self) -> None:
        """Every tiered bucket resident (a swap of the whole model reads or writes all of this rank's state)."""
        self._join()
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
            if bucket_id in self.on_disk or (self.moments is not None and bucket_id in self.moments):
                for i in chunk.segments:
                    opt.optimizer.state.pop(opt.masters[i], None)

    def _master_keys(self, bucket: FlatBucket) -> list[Hashable]:
        return [("master", id(r.bucket), r.start) for r in self._opt.master_runs if r.bucket is bucket]

    def _state_tensors(self, chunk: _Chunk, only: Collection[str] | None = None) -> list[tuple[Hashable, Tensor]]:
        """The chunk's element-wise optimizer-state tensors (``only``: the entries of these names)."""
        opt = self._opt
        found: list[tuple[Hashable, Tensor]] = []
        for i in chunk.segments:
            master = opt.masters[i]
            for name, value in opt.optimizer.state.get(master, {}).items():
                if only is not None and name not in only:
                    continue
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == master.numel():
                    found.append((_state_key(opt, i, name), value))
        return found
