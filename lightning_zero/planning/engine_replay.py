"""The engine's own allocations during a step, replayed onto the step on fake tensors from the strategy's layout.

Note [engine memory replayed]
Plain torch holds every gradient until the step; the engine does not, and it allocates what plain torch never does.
The replay hooks the fake copy of the model (Note [the step on fake tensors]) at the moments the engine acts and
counts, in ``LiveBytes``, what it allocates and frees there, with the sizes of the strategy's own layout of the same
model (``layout.py``):

- Stage 1 (``FullGradReducer``, Note [full gradients between steps]): a bucket's full gradient buffer is allocated
  at its first gradient of the backward, and each gradient autograd computes is copied into its slot and freed.
- Stages 2 and 3 (``ShardedGradReducer``): autograd's gradients are kept until their bucket's reduce-scatter has
  completed; a bucket launches once all its parameters have their gradient (stage 2) or when its unit's backward
  ends (stage 3), at most ``max_inflight_buckets`` are in flight (the oldest completes first), and the first
  reduction of a bucket allocates its gradient shard, which lives until ``zero_grad``. On gloo a reduce-scatter
  receives the chunks it cannot write in place into a buffer of (N-2) shards (N-1 in place, stage 1).
- Stage 3 (``ParameterGatherer``): a unit is gathered in full before its forward and its backward, the next unit in
  the direction of the pass is prefetched (``prefetch_limit_numel``), and it is freed when its forward or its
  backward ends; the root unit is held around the whole step. The recomputation of a checkpointed unit in backward
  runs inside its backward, where it is gathered already.

The order of units is their registration order, the order a transformer calls its layers in; the engine learns
the real order in its first step. Tied parameters, the end-of-backward flush and ZeRO++'s buffers are not replayed
in detail: their bytes are small next to a unit or a bucket, and the prediction is checked against measured peaks
(``tests/test_peak_prediction.py``, ``benchmarks/peak_prediction.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.compat import ModTracker
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.fake_step import LiveBytes
from lightning_zero.planning.layout import BucketSize, StageEstimate, UnitSize
from lightning_zero.sharding.activation_checkpointing import state_dict_name


class _Reductions:
    """Gradient buckets of one backward: when their memory is allocated and freed (Note [engine memory replayed])."""

    def __init__(
        self,
        live: LiveBytes,
        params: dict[str, nn.Parameter],
        config: ZeroConfig,
        world_size: int,
        param_bytes: int,
        gloo: bool,
    ) -> None:
        self.live = live
        self.params = params
        self.config = config
        self.n = world_size
        self.param_bytes = param_bytes
        self.gloo = gloo
        self.inflight: list[BucketSize] = []
        self.reduced: set[int] = set()
        self.held = 0
        """Bytes of gradient buffers and shards the engine holds now (they outlive the backward until the step)."""

    def scratch(self, bucket: BucketSize, in_place: bool) -> int:
        if not self.gloo or self.n <= 1:
            return 0
        return max(self.n - (1 if in_place else 2), 0) * bucket.shard_numel * self.param_bytes

    def allocate(self, nbytes: int) -> None:
        self.live.add("gradients", nbytes)
        self.held += nbytes

    def pooled(self, buckets: list[BucketSize], in_place: bool) -> int:
        """Receive buffers the pool keeps between steps (``ZeroConfig.keep_reduce_buffers``): as many of the largest
        as are in flight at once (Note [size classes] in ``comm/buffer_pool.py``); 0 when the pool is emptied."""
        if not self.config.keeps_reduce_buffers or not buckets:
            return 0
        largest = max(buckets, key=lambda b: b.shard_numel)
        inflight = 1 if in_place else min(self.config.max_inflight_buckets, len(buckets))
        return inflight * self.scratch(largest, in_place)

    def _transient_scratch(self, bucket: BucketSize) -> int:
        return 0 if self.config.keeps_reduce_buffers else self.scratch(bucket, in_place=False)

    def launch(self, bucket: BucketSize) -> None:
        """A bucket's reduce-scatter starts: its shard exists from the first one, its gradients wait for the end."""
        if id(bucket) not in self.reduced:
            self.reduced.add(id(bucket))
            self.allocate(bucket.shard_numel * self.param_bytes)
        self.live.add("gradients", self._transient_scratch(bucket))
        self.inflight.append(bucket)
        while len(self.inflight) > self.config.max_inflight_buckets:
            self._complete(self.inflight.pop(0))

    def _complete(self, bucket: BucketSize) -> None:
        for name in bucket.params:
            param = self.params.get(name)
            if param is not None:
                param.grad = None  # the reduced shard is all that is left of it
        self.live.remove("gradients", self._transient_scratch(bucket))

    def flush(self) -> None:
        while self.inflight:
            self._complete(self.inflight.pop(0))


class EngineReplay:
    """Hooks on the fake model that replay one stage's memory schedule (Note [engine memory replayed])."""

    def __init__(
        self,
        estimate: StageEstimate,
        config: ZeroConfig,
        module: nn.Module,
        live: LiveBytes,
        world_size: int,
        param_bytes: int,
        device: torch.device,
    ) -> None:
        self.estimate = estimate
        self.config = config
        self.module = module
        self.live = live
        self.param_bytes = param_bytes
        # The names state_dict() gives, which the layout's buckets use (Note [checkpoint wrappers keep the names]).
        self.params = {state_dict_name(n): p for n, p in module.named_parameters()}
        self.reductions = _Reductions(live, self.params, config, world_size, param_bytes, device.type == "cpu")
        trainable = [b for b in (*estimate.bucket_sizes, *(b for u in estimate.units for b in u.buckets))]
        self.bucket_of = {name: b for b in trainable if b.trainable for name in b.params}
        self.waiting: dict[int, set[str]] = {}
        self.full_buffers: set[int] = set()
        self.gathered: set[int] = set()
        self.units: list[UnitSize] = list(estimate.units)
        modules = dict(module.named_modules())
        self.unit_of_module = {id(modules[u.name]): i for i, u in enumerate(self.units) if u.name in modules}

    def gradient_state_bytes(self) -> int:
        """The gradients the engine holds from the end of a backward to ``zero_grad``: stage 1's full buffers,
        stages 2 and 3's shards, of every bucket that gets gradients."""
        buckets = [b for b in self.bucket_of.values() if b.trainable]
        unique = {id(b): b for b in buckets}.values()
        if self.estimate.stage == 1:
            return sum(b.padded_numel for b in unique) * self.param_bytes
        return sum(b.shard_numel for b in unique) * self.param_bytes

    def pooled_bytes(self) -> int:
        """The reduction's receive buffers kept between steps (``ZeroConfig.keep_reduce_buffers``)."""
        buckets = list({id(b): b for b in self.bucket_of.values()}.values())
        return self.reductions.pooled(buckets, in_place=self.estimate.stage == 1)

    # -- gradients -------------------------------------------------------------------------------------------------
    def _on_gradient(self, name: str, param: Tensor) -> None:
        if param.grad is not None:
            self.live.mark_gradient(param.grad)
        bucket = self.bucket_of.get(name)
        if bucket is None:
            return
        if self.estimate.stage == 1:
            if id(bucket) not in self.full_buffers:
                self.full_buffers.add(id(bucket))
                self.reductions.allocate(bucket.padded_numel * self.param_bytes)
            param.grad = None  # copied into its slot of the full buffer: Note [full gradients between steps]
            return
        if self.estimate.stage == 2:
            waiting = self.waiting.setdefault(id(bucket), set(bucket.params))
            waiting.discard(name)
            if not waiting:
                self.reductions.launch(bucket)

    # -- stage 3's units ---------------------------------------------------------------------------------------------
    def _gather(self, index: int) -> None:
        if 0 <= index < len(self.units) and index not in self.gathered:
            self.gathered.add(index)
            self.live.add("parameters", self.units[index].numel * self.param_bytes)

    def _release(self, index: int) -> None:
        if index in self.gathered and index != 0:  # the root unit is held around the whole step
            self.gathered.discard(index)
            self.live.remove("parameters", self.units[index].numel * self.param_bytes)

    def _prefetch(self, index: int) -> None:
        limit = self.config.prefetch_limit_numel
        if limit is None or sum(self.units[i].numel for i in self.gathered) + self.units[index].numel <= limit:
            self._gather(index)

    def _unit(self, module: nn.Module | None) -> int | None:
        return None if module is None else self.unit_of_module.get(id(module))

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The hooks, for one forward and backward of the fake model."""
        with ExitStack() as stack:
            for name, param in self.params.items():
                if param.requires_grad:
                    handle = param.register_post_accumulate_grad_hook(lambda p, name=name: self._on_gradient(name, p))
                    stack.callback(handle.remove)
            if self.estimate.stage == 3:
                tracker = ModTracker()
                tracker.register_user_hooks(
                    self._pre_forward, self._post_forward, self._pre_backward, self._post_backward
                )
                stack.enter_context(tracker)
                self._tracker = tracker
                self._gather(0)
            yield

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        index = self._unit(module)
        if index is not None:
            self._gather(index)
            if not self._tracker.is_bw:
                self._prefetch(index + 1)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        index = self._unit(module)
        if index is not None and not self._tracker.is_bw:
            self._release(index)

    def _pre_backward(self, module: nn.Module | None, grad_output: Any) -> None:
        index = self._unit(module)
        if index is not None:
            self._gather(index)
            if index > 1:
                self._prefetch(index - 1)

    def _post_backward(self, module: nn.Module | None, grad_input: Any) -> None:
        index = self._unit(module)
        if index is None:
            return
        self._reduce_unit(index)
        self._release(index)

    def _reduce_unit(self, index: int) -> None:
        for bucket in self.units[index].buckets:
            if bucket.trainable and id(bucket) not in self.reductions.reduced:
                self.reductions.launch(bucket)

    def finish_backward(self) -> None:
        """The end-of-backward flush: every bucket not launched yet is reduced, every gradient is consumed, and
        stage 3 lets the units go (the root unit included)."""
        if self.estimate.stage == 2:
            for bucket in self.estimate.bucket_sizes:
                if bucket.trainable and id(bucket) not in self.reductions.reduced:
                    self.reductions.launch(bucket)
        if self.estimate.stage == 3:
            for index in range(len(self.units)):
                self._reduce_unit(index)
        if self.estimate.stage == 1 and self.estimate.bucket_sizes and not self.config.keeps_reduce_buffers:
            # Stage 1 reduces each full buffer in place, receiving the peers' chunks beside it, one bucket at a time.
            largest = max(self.estimate.bucket_sizes, key=lambda b: b.shard_numel)
            scratch = self.reductions.scratch(largest, in_place=True)
            self.live.add("gradients", scratch)
            self.live.remove("gradients", scratch)
        self.reductions.flush()
        for param in self.params.values():
            param.grad = None
        for index in sorted(self.gathered):
            self.live.remove("parameters", self.units[index].numel * self.param_bytes)
        self.gathered.clear()
