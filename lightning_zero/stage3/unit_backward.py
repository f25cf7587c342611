"""``UnitBackward``: a stage-3 unit's backward, the part of ``ParameterGatherer`` that autograd drives.

Pre-backward (the first gradient of a unit's outputs): gather it, and prefetch the next unit autograd will reach.
Post-backward (its inputs' gradients exist, ``PostBackward``): its gradients go out and it is freed (Note
[post-backward] in ``autograd_hooks.py``). A unit whose inputs need no gradient is freed when its gradients have
arrived (``_on_bucket_complete``, called by the reducer), and the end of the backward frees what is left. Every
launch of a reduction and every gather here happens at points every rank shares (Note [one order of collectives]
in ``comm/streams.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_zero.compat import queue_autograd_callback
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_arrivals import in_nested_backward
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer
from lightning_zero.stage3.autograd_hooks import PostBackwardCounts, Registration
from lightning_zero.stage3.gathered_buffers import GatheredBuffers
from lightning_zero.stage3.sharded_unit import ShardedUnit
from lightning_zero.stage3.unit_order import UnitOrder

__all__ = ["UnitBackward"]


class UnitBackward:
    """Gathering and freeing units in backward: mixed into ``ParameterGatherer``, which owns the state."""

    if TYPE_CHECKING:  # provided by ParameterGatherer
        units: list[ShardedUnit]
        reducer: ShardedGradReducer
        buffers: GatheredBuffers
        _backward_callback_queued: bool
        _remaining: dict[int, int]
        _finish_order: UnitOrder
        _reached_in_backward: set[int]
        _children: dict[int, list[ShardedUnit]]
        _post_backwards: PostBackwardCounts
        _depth: dict[int, int]
        _single_arrivals: dict[int, bool]
        _unit_of_bucket: dict[int, ShardedUnit]
        _inputs_hooked: dict[int, bool]
        _freed_by_arrivals: set[int]
        _order_frozen: bool

        def _owner(self, unit: ShardedUnit) -> ShardedUnit: ...
        def _gather(self, unit: ShardedUnit, prefetch: bool = False, exact: bool = False) -> None: ...
        def _wait(self, unit: ShardedUnit) -> None: ...
        def _release(self, unit: ShardedUnit, reuse: bool = False) -> None: ...
        def _reused_soon(self, unit: ShardedUnit, order: UnitOrder) -> bool: ...
        def _prefetch(self, unit: ShardedUnit, order: UnitOrder, only: set[int] | None = None) -> None: ...
        def _end_of_pass(self) -> None: ...
        def release_all(self, keep: ShardedUnit | None = None) -> None: ...

    @torch.compiler.disable  # Note [placeholders under compile]
    def _pre_backward(self, unit: ShardedUnit, grad: Any) -> None:
        unit = self._owner(unit)
        if not self._backward_callback_queued:
            queue_autograd_callback(self._on_backward_end)
            self._backward_callback_queued = True
            self.reducer.queue_flush()  # after ours: rounds end before the last reductions (Note [bucket flush])
            self._remaining = {u.index: len(u.trainable_buckets) for u in self.units}
        # Autograd is about to run this use of the unit: its parameters are needed, even if its own gradients are
        # complete (a unit called several times still computes input gradients for every call).
        self._gather(unit)
        self._wait(unit)
        self._prefetch(unit, self._finish_order, only=self._reached_in_backward)

    @torch.compiler.disable  # Note [placeholders under compile]
    def _post_backward(self, unit: ShardedUnit, where: Registration) -> None:
        if self._owner(unit) is not unit:
            return
        # The units merged into this one are done too, used or not: their gradients go out now.
        done = [b for child in self._children[unit.index] for b in child.trainable_buckets]
        last = self._post_backwards.ran(unit.index, where)
        if last and (where is Registration.FORWARD or self._single_arrival(unit)):
            done = unit.trainable_buckets + done  # Note [one order of collectives]: this unit's backward is over
        self.reducer.complete(done)
        if self._depth[unit.index] == 0:  # Note [post-backward]
            self._release(unit, reuse=self._reused_soon(unit, self._finish_order))

    def _single_arrival(self, unit: ShardedUnit) -> bool:
        """Whether every rank knows that each parameter of ``unit`` gets its gradient in one reentrant segment's
        backward (learned in the first backward, maxed over ranks: Note [final gradients])."""
        arrivals = self.reducer.arrivals
        if arrivals.learning:
            return False
        single = self._single_arrivals.get(unit.index)
        if single is None:  # fixed once learned
            positions = (arrivals.position(b.index, i) for b in unit.trainable_buckets for i in range(len(b.params)))
            single = self._single_arrivals[unit.index] = all(arrivals.expected[p] == 1 for p in positions)
        return single

    def _on_bucket_complete(self, bucket: FlatBucket) -> None:
        member = self._unit_of_bucket.get(id(bucket))
        if member is None:  # a resident bucket
            return
        self._remaining[member.index] -= 1
        unit = self._owner(member)
        if any(self._remaining[m.index] for m in self._children[unit.index]):
            return
        # A unit whose inputs need no gradient is done once its own gradients are (Note [post-backward]); any other
        # unit waits for its post-backward, since computing its input gradient still reads its parameters. Not in a
        # reentrant segment's backward: that one goes on to its segment's input gradient, reading them too.
        if (
            self._remaining[unit.index] == 0
            and self._depth[unit.index] == 0
            and not self._inputs_hooked[unit.index]
            and not in_nested_backward()
        ):
            self._freed_by_arrivals.add(unit.index)  # Note [one order of collectives]
            unit.count_while_sharded(True)
            self._release(unit, reuse=self._reused_soon(unit, self._finish_order))

    def _on_backward_end(self) -> None:
        self._backward_callback_queued = False
        self._reached_in_backward.clear()
        self._post_backwards.reset()
        for index in self._freed_by_arrivals:
            self.units[index].count_while_sharded(False)
        self._freed_by_arrivals.clear()
        self._end_of_pass()
        self._order_frozen = True
        self.release_all()
        self.buffers.clear()  # Note [gathered buffers reused]
