"""Gradient reduction: from each rank's local gradients to this rank's averaged gradient shard.

Two storages, one protocol. Both reducers register a post-accumulate-grad hook on every parameter, count arrivals per
bucket, and reduce-scatter buckets strictly in bucket order (Note [bucket order]); they differ in where gradients
live between backward and the optimizer step:

- ``FullGradReducer`` (stage 1, ``full_grad_reducer.py``): each bucket has a full-size gradient buffer from its
  first gradient to ``zero_grad()``, and every parameter's ``.grad`` is a view into it, so autograd accumulates in
  place. Buckets are reduce-scattered once per optimizer step: from the hooks during the last backward before the
  step (``overlap_comm``), or at the step.
- ``ShardedGradReducer`` (stage 2, ``sharded_grad_reducer.py``): a full-size buffer exists only while a bucket is
  filling or in flight; each backward reduce-scatters every bucket and accumulates into a persistent shard, so
  gradient memory is 1/N.

Note [buffers between steps]
The receive and staging buffers come from a pool, so a backward allocates a few of them rather than two per bucket.
By default (``ZeroConfig.keep_reduce_buffers``) stages 1 and 2 keep the pool between steps: a few buffers of
``bucket_numel`` (as DDP and DeepSpeed keep their bucket buffers). Stage 3 empties it at the end of every backward:
its buckets are whole units, the largest often the root with the embeddings, and buffers of that size held through
the next forward would sit on top of the activations, at the step's memory peak. On gloo, stages 2 and 3 stage
nothing (Note [gradients sent from where autograd put them] in ``sharded_grad_reducer.py``) and receive straight
into their shards, so on two ranks the pool stays empty; beyond two it holds the receive rows of N-2 chunks.

Note [bucket flush]
A bucket is launched when all its parameters' gradients are final (Note [final gradients] in
``gradient_arrivals.py``), but some parameters may get no gradient in a given backward (unused branches, frozen
paths), so some buckets never complete by counting. The first hook of each backward queues a callback on the
autograd engine that runs when the whole backward is done; it launches every bucket not yet launched, in order, and
waits for all of them. Every rank therefore issues every bucket exactly once per reduction, in the same order,
whatever the data did to its own backward, and no reduction is still reading a buffer when the next backward starts
writing gradients into it. Reentrant activation checkpointing runs a nested backward inside the step's own; a flush
queued there would run when the nested one ends, launching every bucket before most gradients exist (and again
later: twice the bytes). The callback therefore does nothing when an autograd node is still executing around it
(``torch._C._current_autograd_node()``: the nested backward's caller), and the next gradient of the enclosing
backward queues it again.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.comm.buffer_pool import BufferPool
from lightning_zero.comm.collectives import ProcessGroup, receive_buffer_numel, receive_buffer_sizes, reduce_scatter
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.comm.streams import CollectiveStream
from lightning_zero.compat import current_autograd_node, queue_autograd_callback
from lightning_zero.config import ZeroConfig, dtype_from_name
from lightning_zero.sharding.flat_bucket import FlatBucket, ParamSlot
from lightning_zero.sharding.gradient_arrivals import GradientArrivals, late_gradient_error
from lightning_zero.sharding.gradient_owners import GradientOwners, local_gradients_error
from lightning_zero.sharding.launch_order import LaunchOrder


class BucketState(enum.Enum):
    """Where a bucket's gradients are in the current reduction round."""

    FILLING = "filling"
    """Gradients of the current backward are arriving. Stage 1: the full buffer lives until zero_grad (1x bucket).
    Stage 2: a full staging buffer exists from the first arrival (1x bucket, transient)."""
    IN_FLIGHT = "in_flight"
    """The reduce-scatter is issued; its buffers are held until it completes."""
    REDUCED = "reduced"
    """This rank's averaged shard is final until the next backward adds to it."""


class GradientReducer:
    """The shared protocol: hooks, ordered launch, end-of-backward flush. Subclasses own the storage."""

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        group: ProcessGroup,
        config: ZeroConfig,
        ledger: CommLedger,
        on_complete: Callable[[FlatBucket], None] | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.on_complete = on_complete
        """Called when every gradient of a bucket is final in a backward (stage 3 frees the unit then); not for a
        bucket whose finality the first backward cannot tell (Note [final gradients])."""
        self.group = group
        self.world_size = group.size()
        self.config = config
        self.ledger = ledger
        self.require_sync = True
        """False inside ``no_sync()``: backward only accumulates locally (gradient accumulation)."""
        self.state = [BucketState.FILLING] * len(self.buckets)
        self.arrivals = GradientArrivals(self.buckets)
        """Which parameters' gradients are final in the backward running now (Note [final gradients])."""
        self.present = bytearray(self.arrivals.positions)
        """Per parameter (``arrivals.position``): 1 once a gradient arrived on this rank, in any backward (``no_sync``
        ones too), until the optimizer that steps it resets it (Note [unused parameters] in ``gradient_presence.py``).
        Set by the one hook the parameter has."""
        self.owners = GradientOwners(self.buckets)
        """Which optimizer steps which elements of each shard (Note [gradients of several optimizers])."""
        self._launched = [False] * len(self.buckets)
        """Buckets launched in the current round: a gradient arriving for one is an error (Note [final gradients])."""
        self._callback_queued = False
        self.launch_order = LaunchOrder(self.buckets)
        """The order buckets are reduced in, and this round's progress through it (Note [bucket order])."""
        self.completed_by_caller: set[int] = set()
        """Buckets whose completion the caller declares (``complete()``) instead of counting gradient arrivals:
        stage 3's data-dependent units, which some ranks use and others not (Note [data-dependent units])."""
        self.launch_by_caller = False
        """Stage 3: the hooks count gradients but launch nothing; a bucket is launched only once the caller has
        declared it complete (``complete()``) or by the flush (Note [one order of collectives] in
        ``comm/streams.py``)."""
        self._declared: set[int] = set()
        """Buckets declared complete in the current round (``complete()``)."""
        self._in_flight: deque[tuple[FlatBucket, PendingCollective]] = deque()
        self.pool = BufferPool()
        """Receive buffers (and stage 2's staging buffers), reused across buckets (Note [buffers between steps])."""
        for bucket in self.buckets:
            for numel in (bucket.padded_numel, *receive_buffer_sizes(bucket.shard_numel, bucket.device, group)):
                self.pool.reserve(numel, self._reduce_dtype(bucket), bucket.device)
        self._lent: list[list[Tensor]] = [[] for _ in self.buckets]
        """Pooled buffers an in-flight bucket's collective uses; back to the pool when it completes."""
        self.reduced_hooks: list[Callable[[FlatBucket], None]] = []
        """Called with each bucket whose reduction has completed (its shard is final for this round): the host tier
        copies the shard to host memory then (Note [host tier data path] in ``offload/host_copies.py``)."""
        self.stream = CollectiveStream(self.buckets[0].device if self.buckets else torch.device("cpu"))
        """The reduce-scatters' side stream (Note [collective streams]); inert on the CPU."""
        self.reduce_scatter: Callable[..., PendingCollective] = reduce_scatter
        """Issues a bucket's reduce-scatter, with ``collectives.reduce_scatter``'s signature; ZeRO++'s qgZ swaps in
        ``comm.hierarchical_reduce.HierarchicalReduceScatter``."""
        self._handles: list[RemovableHandle] = []
        for bucket in self.buckets:
            for i, (slot, param) in enumerate(bucket.slots_and_params()):
                hook = partial(self._on_grad_accumulated, bucket, slot, self.arrivals.position(bucket.index, i))
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self._init_storage()

    # -- subclass storage API ------------------------------------------------------------------------------------
    def _init_storage(self) -> None:
        """Create the subclass's gradient storage, once the shared state above exists (the end of ``__init__``)."""
        raise NotImplementedError

    def _store(self, bucket: FlatBucket, slot: ParamSlot, param: nn.Parameter) -> None:
        raise NotImplementedError

    def _communicates_now(self) -> bool:
        """Whether the backward running now launches reductions from its hooks."""
        raise NotImplementedError

    def _launch(self, bucket: FlatBucket) -> PendingCollective:
        raise NotImplementedError

    def _complete(self, bucket: FlatBucket) -> None:
        """Runs once the bucket's collective has finished (release staging, accumulate)."""

    def grad_shard(self, bucket: FlatBucket) -> Tensor:
        """This rank's averaged gradient shard of ``bucket`` (valid once ``finish()`` returned)."""
        raise NotImplementedError

    def _consume(self, buckets: Sequence[FlatBucket]) -> None:
        """Every step that reads ``buckets`` has used their reduced shards: their next reduction starts from zero."""
        raise NotImplementedError

    def _zero_grad(self, buckets: Sequence[FlatBucket], set_to_none: bool) -> None:
        """Start the next accumulation of ``buckets`` from zero; ``set_to_none`` may free their storage."""
        raise NotImplementedError

    def _zero_spans(self, bucket: FlatBucket, owner: int) -> None:
        """Zero ``owner``'s spans of the bucket's reduced shard, keeping the rest (Note [gradients of several
        optimizers])."""
        if self._has_local_gradients(bucket):
            raise local_gradients_error(bucket)
        shard = self.grad_shard(bucket)
        for start, stop in self.owners.spans(bucket)[owner]:
            shard[start:stop].zero_()

    def _has_local_gradients(self, bucket: FlatBucket) -> bool:
        """Whether the bucket holds gradients of a backward that did not reduce them (yet)."""
        return False

    def _release(self, owner: int | None) -> list[FlatBucket]:
        """Zero ``owner``'s spans where another optimizer still owes its step; the buckets done with whole."""
        whole, partial = self.owners.release(owner, self.buckets)  # Note [gradients of several optimizers]
        for bucket in partial:
            assert owner is not None
            self._zero_spans(bucket, owner)
        return whole

    def consume(self, owner: int | None = None) -> None:
        """``owner``'s step (None: every one) has used its gradients (Note [gradients of several optimizers])."""
        self._consume(self._release(owner))

    def zero_grad(self, set_to_none: bool = True, owner: int | None = None) -> None:
        """Start the next accumulation of ``owner``'s gradients (None: all of them) from zero; ``set_to_none`` may
        free gradient storage until it is needed."""
        self.wait()
        self._drop_round()
        whole = self._release(owner)
        self._zero_grad(whole, set_to_none)
        for bucket in whole:
            self.state[bucket.index] = BucketState.FILLING

    def state_bytes(self) -> int:
        """Bytes of gradient storage this rank holds between steps."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Bytes of reusable communication buffers (not model state: a few buckets' worth, whatever the model)."""
        return self.pool.nbytes()

    # -- protocol ------------------------------------------------------------------------------------------------
    def _reduce_dtype(self, bucket: FlatBucket) -> torch.dtype:
        name = self.config.reduce_dtype
        return bucket.dtype if name is None else dtype_from_name(name)

    def _on_grad_accumulated(self, bucket: FlatBucket, slot: ParamSlot, position: int, param: nn.Parameter) -> None:
        self.present[position] = 1
        if self._launched[bucket.index]:
            raise late_gradient_error(slot)
        if self.state[bucket.index] is not BucketState.FILLING:
            self._begin_filling(bucket)
        self._store(bucket, slot, param)
        if not self._communicates_now():
            return
        self.queue_flush()
        if bucket.index in self.completed_by_caller:
            return
        if self.arrivals.arrive(bucket.index, position):  # Note [final gradients]
            self.launch_order.observe(bucket)
            if self.on_complete is not None and not self.arrivals.held(bucket.index):
                self.on_complete(bucket)
            if not self.launch_by_caller:
                self._launch_complete_in_order()

    def queue_flush(self) -> None:
        """Have the backward running now flush every bucket when it ends (Note [bucket flush]). The reducer's own
        hooks call this at the first gradient; calling it from a hook that runs earlier in the same backward (stage
        3's first pre-backward) makes sure the flush belongs to the outermost backward. A backward that does not
        communicate (inside ``no_sync()`` with local accumulation) queues nothing."""
        if self._communicates_now() and not self._callback_queued:
            # See Note [bucket flush].
            queue_autograd_callback(self._on_backward_end)
            self._callback_queued = True

    def complete(self, buckets: Sequence[FlatBucket]) -> None:
        """Declare ``buckets`` (of ``completed_by_caller``) complete for this backward: launch them in order."""
        if not self._communicates_now():
            return
        self.queue_flush()
        for bucket in buckets:
            self.arrivals.declare_final(bucket.index)
            self._declared.add(bucket.index)
            self.launch_order.observe(bucket)
        self._launch_complete_in_order()

    def _begin_filling(self, bucket: FlatBucket) -> None:
        if self.state[bucket.index] is BucketState.IN_FLIGHT:
            # A backward touches a bucket whose previous reduction is still in flight: finish that one first.
            self.wait()
        self.state[bucket.index] = BucketState.FILLING

    def _launch_complete_in_order(self) -> None:
        """Launch buckets whose gradients have all arrived, never skipping an earlier incomplete one."""
        while (bucket := self.launch_order.upcoming()) is not None:
            if not self.arrivals.launchable(bucket.index):
                return
            if self.launch_by_caller and bucket.index not in self._declared:
                return
            self._launch_one(bucket)
            self.launch_order.advance()

    def _launch_one(self, bucket: FlatBucket) -> None:
        if self.state[bucket.index] is not BucketState.FILLING:
            self._begin_filling(bucket)
        while len(self._in_flight) >= self.config.max_inflight_buckets:
            self._wait_oldest()
        pending = self.ledger.record(self._launch(bucket))
        self.owners.reduced(bucket)
        self.state[bucket.index] = BucketState.IN_FLIGHT
        self._launched[bucket.index] = True
        self._in_flight.append((bucket, pending))
        if not self.config.overlap_comm:
            self.wait()

    def _launch_remaining(self) -> None:
        for bucket in self.launch_order.remaining():
            self._launch_one(bucket)

    def _end_round(self) -> None:
        """Every bucket has been launched: the next backward starts a new round."""
        self.launch_order.restart()
        self._launched = [False] * len(self.buckets)
        self._declared.clear()
        self.arrivals.reset()

    def _drop_round(self) -> None:
        """At ``zero_grad()``: forget what a backward that never reached its flush (it raised) left of its round, so
        that the next backward starts one afresh instead of taking its gradients for late ones."""
        self._callback_queued = False
        self._end_round()

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if current_autograd_node() is not None:
            return  # a nested backward ended inside an enclosing one (Note [bucket flush])
        self._launch_remaining()
        # Nothing stays in flight past the backward that produced it: stage 1's buffers are autograd's
        # accumulation target for the next backward, and stage 2's staging buffers are memory we promised to free.
        self.wait()
        self.launch_order.adopt_observed(self.arrivals, self.group)  # Note [bucket order]
        self._end_round()
        if not self.config.keeps_reduce_buffers:
            self.pool.clear()  # Note [buffers between steps]

    def _reduce_scatter(self, bucket: FlatBucket, output: Tensor, input: Tensor) -> PendingCollective:
        """Issue the bucket's reduce-scatter on the reduce-scatter stream. Only gloo's form may receive into a
        separate buffer (N-2 chunks, or N-1 in place; none on two ranks): that one is pooled and held until the
        bucket completes (NCCL needs none)."""
        scratch = None
        numel = receive_buffer_numel(output, input, self.group)
        if numel:
            scratch = self.pool.take(numel, input.dtype, input.device)
            self._lent[bucket.index].append(scratch)
        return self.reduce_scatter(output, input, self.group, scratch=scratch, stream=self.stream)

    def _wait_oldest(self) -> None:
        bucket, pending = self._in_flight.popleft()
        pending.wait()  # compute is ordered after the collective from here on: Note [collective streams]
        self._complete(bucket)
        for buffer in self._lent[bucket.index]:
            self.pool.give(buffer)
        self._lent[bucket.index].clear()
        self.state[bucket.index] = BucketState.REDUCED
        for hook in self.reduced_hooks:
            hook(bucket)

    def wait(self) -> None:
        while self._in_flight:
            self._wait_oldest()

    def finish(self) -> None:
        """Make every bucket's gradient shard final: launch what the hooks did not, then wait for all of it."""
        if any(state is BucketState.FILLING for state in self.state):
            self._launch_remaining()
            self._end_round()
        self.wait()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for every backward inside the context."""
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def accumulate_into(total: Tensor, out: Tensor, pending: PendingCollective) -> PendingCollective:
    """Once ``pending`` has written ``out``, add it into ``total`` (gradient accumulation across reductions)."""
    first = pending.finish

    def finish() -> None:
        if first is not None:
            first()
        total.add_(out)

    pending.finish = finish
    return pending
