"""``ParameterGatherer``: when each stage-3 unit is gathered and freed, through module and autograd hooks.

Per step, for each unit:  pre-forward: gather (+ prefetch the next unit), hook the inputs  ->  forward  ->
post-forward: free, and hook the outputs  ->  pre-backward (first output gradient): gather (+ prefetch the previous
unit)  ->  backward  ->  post-backward (the inputs' gradients exist): free (Note [post-backward] in
``autograd_hooks.py``).  Communication: two all-gathers and one reduce-scatter of every parameter, 3Ψ(N-1)/N per
rank. Prefetching follows the order of the previous passes (Note [forward order] in ``unit_order.py``).

Note [placeholders under compile]
``torch.compile`` traces a module's forward hooks with it, and would compile the gather (whose collectives and
parameter swaps it cannot trace) and specialize the graph on whatever the parameters were while tracing. Every hook
is therefore excluded from tracing (``torch.compiler.disable``): the graph breaks at each unit boundary, the hook
runs eagerly and gathers, and the graph that follows reads the parameters as inputs when it runs, i.e. gathered,
contiguous, with their real strides; a placeholder (Note [placeholders]) never reaches a compiled graph. Compiling
the whole model or each block (in ``configure_model``) both work; the graph breaks are the price.

Note [recomputation]
Activation checkpointing re-runs a unit's forward inside backward. The unit is already gathered by its pre-backward
hook; the re-run must neither free it afterwards nor hook its outputs again. Hooks recognize it because autograd is
executing a graph task (``torch._C._current_graph_task_id() != -1``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import partial
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.comm.collectives import ProcessGroup
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.compat import current_graph_task_id
from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer
from lightning_zero.stage3.autograd_hooks import (
    PostBackwardCounts,
    Registration,
    hook_inputs,
    only_parameters_reached,
    tensors_in,
)
from lightning_zero.stage3.divergence import NOTHING, RankDivergenceError, UnitExchange
from lightning_zero.stage3.gathered_buffers import GatheredBuffers
from lightning_zero.stage3.one_rank_calls import OneRankCalls
from lightning_zero.stage3.outside_step import OutsideStep
from lightning_zero.stage3.sharded_unit import LiveNumel, ShardedUnit, UnitState
from lightning_zero.stage3.unit_backward import UnitBackward
from lightning_zero.stage3.unit_order import UnitOrder

__all__ = ["ParameterGatherer", "RankDivergenceError"]


def _in_backward() -> bool:
    return current_graph_task_id() != -1


class ParameterGatherer(OutsideStep, UnitBackward):
    """Owns the stage-3 units of one model, the resident (persistent) buckets, and the gradient reducer over both;
    gathers in backward through ``UnitBackward`` (``unit_backward.py``) and outside a step through ``OutsideStep``
    (``outside_step.py``)."""

    def __init__(
        self,
        root: nn.Module,
        units: list[ShardedUnit],
        resident_buckets: list[FlatBucket],
        group: ProcessGroup,
        config: ZeroConfig,
        device: torch.device,
        reducer_factory: Callable[..., ShardedGradReducer] = ShardedGradReducer,
    ) -> None:
        """``reducer_factory``: builds the gradient reducer (the memory tiers pass one that keeps shards on disk)."""
        assert units, "there is always a root unit"
        assert units[0].module is root, "unit 0 is the root unit"
        self.root = root
        self.units = units
        self.resident_buckets = resident_buckets
        self.group = group
        self.gather_group = group
        """The group unit gathers run on; its own once data-dependent units exist (Note [data-dependent units])."""
        self.config = config
        self.device = device
        self.ledger = CommLedger()
        self._unit_of_bucket = {id(b): u for u in units for b in u.buckets}
        self._remaining = {u.index: 0 for u in units}  # trainable buckets still waiting for gradients
        self._reached_in_backward: set[int] = set()
        """Units whose outputs of this step's forward have a pre-backward hook: the ones backward will gather."""
        self._inputs_hooked = {u.index: False for u in units}
        """Whether the unit's last forward hooked an input that requires grad, or made a tensor require grad that is
        no parameter: either way it is not freed when its gradients arrive (Note [post-backward])."""
        self._depth = {u.index: 0 for u in units}  # nested forward calls of the same unit
        self._forward_order = UnitOrder()  # Note [forward order]
        self._finish_order = UnitOrder(reverse=True)  # backward's: the reverse of the order forwards finish in
        self._order_frozen = False
        self._backward_callback_queued = False
        self.buffers = GatheredBuffers(device)
        """Memory of released units kept for the next gathers of this pass (Note [gathered buffers reused])."""
        self.exchange = UnitExchange(units, group, device)
        """The index exchanges that keep ranks' gathers paired (Note [divergence check])."""
        self._rounds = group.size() > 1
        """Whether first-step gathers are rounds (Note [data-dependent units]); a world of one needs none."""
        self._checks_later = group.size() > 1 and config.checks_rank_divergence_on(device)
        self._children: dict[int, list[ShardedUnit]] = {u.index: [] for u in units}
        """Units merged into each unit, gathered and freed with it (Note [data-dependent units])."""
        # Gradient buckets in launch order: roughly the order backward completes them (Note [bucket order]).
        buckets = [b for u in reversed(units[1:]) for b in u.trainable_buckets]
        buckets += units[0].trainable_buckets + [b for b in resident_buckets if b.trainable]
        for i, bucket in enumerate(buckets):
            bucket.index = i
        self.reducer = reducer_factory(buckets, group, config, self.ledger, on_complete=self._on_bucket_complete)
        self.reducer.launch_by_caller = True  # Note [one order of collectives]
        self._post_backwards = PostBackwardCounts(u.index for u in units)
        self._freed_by_arrivals: set[int] = set()
        """Units freed in this backward when their gradients arrived: still counted as live by the prefetch limit."""
        self._live = LiveNumel()  # what the prefetch limit counts, kept up to date by the units themselves
        for unit in units:
            assert unit.state is UnitState.SHARDED, unit
            unit.live = self._live
        self._single_arrivals: dict[int, bool] = {}
        self.calls: OneRankCalls | None = None
        """Set on a group of several ranks: calls outside a step meet the other ranks first (Note [one-rank calls])."""
        self._call_depth = 0
        self._served_depth: dict[int, int] = {}
        self._held: dict[int, int] = {}
        """Units gathered by ``gathered()`` contexts (nesting counted): a forward inside one does not free them (Note
        [edits discarded at exit] in ``outside_step.py``)."""
        self._handles: list[RemovableHandle] = []
        for unit in units:
            pre_hook = partial(self._pre_forward_hook, unit)
            self._handles.append(unit.module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            # always_call: a forward that raises must still free its unit, or a retried step would see stale weights.
            post_hook = partial(self._post_forward_hook, unit)
            self._handles.append(unit.module.register_forward_hook(post_hook, always_call=True))
        self._hook_root_modules()

    def _hook_root_modules(self) -> None:
        """Modules holding the root unit's sharded parameters gather it when called outside a step (sampling in a
        Lightning hook, generation after fit): within a step the root is gathered already, and the calls nest."""
        root = self.units[0]
        owned = {id(p) for b in root.buckets for p in b.params}
        for module in self.root.modules():
            if module is self.root or not any(id(p) in owned for p in module.parameters(recurse=False)):
                continue
            self._handles.append(module.register_forward_pre_hook(partial(self._root_pre_forward_hook, root)))
            post = partial(self._post_forward_hook, root)
            self._handles.append(module.register_forward_hook(post, always_call=True))

    @property
    def trainable_buckets(self) -> list[FlatBucket]:
        return self.reducer.buckets

    def all_buckets(self) -> list[FlatBucket]:
        """Every bucket of the sharded model: each unit's (frozen ones included), then the resident ones."""
        return [b for unit in self.units for b in unit.buckets] + self.resident_buckets

    # -- forward --------------------------------------------------------------------------------------------------
    @torch.compiler.disable  # Note [placeholders under compile]
    def _pre_forward_hook(
        self, unit: ShardedUnit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.pre_forward(unit)
        if not torch.is_grad_enabled():
            return None
        where = Registration.now(_in_backward())
        args, kwargs, hooked = hook_inputs(args, kwargs, partial(self._post_backward, unit, where))
        if where is Registration.FORWARD:  # a recomputation's inputs say nothing about the step's own forward
            self._inputs_hooked[unit.index] = hooked
        if hooked:
            self._post_backwards.registered(unit.index, where)
        return args, kwargs

    @torch.compiler.disable  # Note [placeholders under compile]
    def _root_pre_forward_hook(self, root: ShardedUnit, module: nn.Module, args: Any) -> None:
        self.pre_forward(root)

    @torch.compiler.disable  # Note [placeholders under compile]
    def _post_forward_hook(self, unit: ShardedUnit, module: nn.Module, args: Any, output: Any) -> None:
        self.post_forward(unit, output)

    def _owner(self, unit: ShardedUnit) -> ShardedUnit:
        """The unit that gathers ``unit``: itself, or the unit it was merged into (Note [data-dependent units])."""
        return self.units[self.exchange.merged_into.get(unit.index, unit.index)]

    def pre_forward(self, unit: ShardedUnit) -> None:
        # Note [one-rank calls]: a training forward (gradients on, no call begun) pays two checks here, nothing more.
        calls_here = self.calls is not None and (self._call_depth > 0 or not torch.is_grad_enabled())
        if calls_here and self._call_pre_forward(unit):
            return
        owner = self._owner(unit)
        if owner is not unit:  # gathered with its owner, whose forward encloses this one
            if owner.state is UnitState.SHARDED:  # called on its own after all: gather the owner for the call
                self._gather(owner)
            self._wait(owner)
            return
        if _in_backward():  # Note [recomputation]
            self._gather(unit)
            self._wait(unit)
            return
        if unit.index == 0 and self._depth[0] == 0 and self._checks_later and self._order_frozen:
            self.exchange.verify_all()  # last step's prefetch checks, long complete (Note [divergence check])
        self._depth[unit.index] += 1
        if self._depth[unit.index] > 1:
            return
        if not self._order_frozen:
            self._forward_order.record(unit.index)  # Note [forward order]
        self._gather(unit)
        self._wait(unit)
        self._prefetch(unit, self._forward_order)

    def post_forward(self, unit: ShardedUnit, output: Any) -> None:
        if self._call_depth > 0 and self._call_post_forward(unit):  # Note [one-rank calls]
            return
        if _in_backward() or self._owner(unit) is not unit:  # Note [recomputation]; a merged unit
            return
        self._depth[unit.index] -= 1
        if self._depth[unit.index] > 0:
            return
        if not self._order_frozen:
            self._finish_order.record(unit.index)
        differentiated = False
        if torch.is_grad_enabled():
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                members = (unit, *self._children[unit.index])
                frees_on_arrivals = any(m.trainable_buckets for m in members) and not self._inputs_hooked[unit.index]
                # The root's graph is the whole model's, not walked at every step: the root is freed at the end of
                # backward, as FSDP2 frees its root (Note [post-backward]).
                if frees_on_arrivals and (unit.index == 0 or not only_parameters_reached(tensors)):
                    self._inputs_hooked[unit.index] = True  # freed at the end of backward (Note [post-backward])
                torch.autograd.graph.register_multi_grad_hook(tensors, partial(self._pre_backward, unit), mode="any")
                self._reached_in_backward.add(unit.index)
                differentiated = True
        if unit.index == 0:
            self._end_of_pass()
        keep = unit.index == 0 and differentiated and not self.config.reshard_root_after_forward and self._order_frozen
        if not keep and not self._held.get(unit.index):  # the root kept into backward; a unit gathered() holds
            self._release(unit, reuse=self._reused_soon(unit, self._forward_order))
        if unit.index == 0:
            # The whole forward is over: a unit prefetched for it but never called (a branch not taken, a step
            # that only read some weights) is freed now rather than held until the next backward or step.
            self.release_all(keep=unit if keep else None)
            self.buffers.clear()  # Note [gathered buffers reused]

    # -- gathering --------------------------------------------------------------------------------------------------
    def _gather(self, unit: ShardedUnit, prefetch: bool = False, exact: bool = False) -> None:
        """Issue the all-gather of ``unit`` and of the units merged into it (``exact``: see ``ShardedUnit.gather``)."""
        if unit.state is not UnitState.SHARDED:
            return
        if self._rounds and not self._order_frozen:
            assert not prefetch, "nothing is prefetched before the order is recorded"
            self._round(unit.index)
            return
        if self._checks_later:
            self.exchange.issue_check(unit)
            if not prefetch:
                self.exchange.verify(unit)  # Note [divergence check]
        for member in (unit, *self._children[unit.index]):
            member.gather(self.gather_group, self.ledger, self.buffers, exact=exact)

    def _round(self, wanted: int) -> list[int]:
        """One round (Note [data-dependent units]): every unit any rank asks for is gathered by every rank."""
        asked = self.exchange.round(wanted)
        for index in asked:
            owner = self._owner(self.units[index])
            for member in (owner, *self._children[owner.index]):
                if member.state is UnitState.SHARDED:
                    member.gather(self.gather_group, self.ledger)
                else:  # gathered here already: take part again, writing the same values
                    member.wait()
                    for bucket in member.buckets:
                        assert bucket.data is not None
                        self.ledger.record(member.gather_comm.gather(bucket, bucket.data, self.gather_group)).wait()
        return asked

    def _end_of_pass(self) -> None:
        """The end of a forward (the root's) or of a backward in the first step: answer rounds until no rank asks
        for anything, then merge the units whose use differed between ranks (Note [data-dependent units])."""
        if not self._rounds or self._order_frozen:
            return
        while self._round(NOTHING):
            pass
        merged = self.exchange.merge_divergent()
        for index in merged:
            owner = self.units[self.exchange.merged_into[index]]
            self._children[owner.index].append(self.units[index])
            self.reducer.completed_by_caller.update(b.index for b in self.units[index].trainable_buckets)
        if merged and self.gather_group is self.group:
            # From now on gradient reductions may be issued at points that differ between ranks: gathers get a
            # communicator of their own so that the two never pair with each other (Note [data-dependent units]).
            ranks = dist.get_process_group_ranks(self.group)
            timeout = timedelta(seconds=self.config.collective_timeout_s)
            self.gather_group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
            self.exchange.group = self.gather_group
        if merged:
            self._forward_order.remove(self.exchange.merged_into.keys())
            self._finish_order.remove(self.exchange.merged_into.keys())

    def _wait(self, unit: ShardedUnit) -> None:
        if self._checks_later:
            self.exchange.verify(unit)
        for member in (unit, *self._children[unit.index]):
            member.wait()

    def _release(self, unit: ShardedUnit, reuse: bool = False) -> None:
        """Free ``unit`` and the units merged into it; with ``reuse``, keep their memory for the next gathers
        (Note [gathered buffers reused])."""
        if self._checks_later:
            self.exchange.verify(unit)
        keep_in = self.buffers if reuse else None
        for member in (unit, *self._children[unit.index]):
            member.release(keep_in)

    def _reused_soon(self, unit: ShardedUnit, order: UnitOrder) -> bool:
        """Whether a unit a few places after ``unit`` in this pass's ``order``, not gathered yet, has a bucket of
        the byte size of one of ``unit``'s: its gather would take the memory ``unit`` releases (Note [gathered
        buffers reused]). Looks no further than prefetching reaches, so kept memory is taken almost at once."""
        if not self.buffers.enabled or not self._order_frozen or unit.index not in order:
            return False
        only = self._reached_in_backward if _in_backward() else None  # only the units autograd will reach
        mine = {b.full_nbytes for m in (unit, *self._children[unit.index]) for b in m.buckets}
        for index in islice(order.following(unit.index, only), 2):
            later = self.units[index]
            if later.state is UnitState.SHARDED and any(
                b.full_nbytes in mine for m in (later, *self._children[index]) for b in m.buckets
            ):
                return True
        return False

    def _prefetch(self, unit: ShardedUnit, order: UnitOrder, only: set[int] | None = None) -> None:
        """Issue the gather of the unit after ``unit`` in ``order`` if the live-elements limit allows; in backward,
        the next unit autograd will reach (``only``): a frozen unit it never reaches is not gathered at all."""
        limit = self.config.prefetch_limit_numel
        if limit == 0 or (self._rounds and not self._order_frozen):
            return
        following = next(order.following(unit.index, only), None)
        if following is None:
            return
        target = self.units[following]
        if target.state is not UnitState.SHARDED:
            return
        # Rank-independent (Note [one order of collectives]): a unit freed when its gradients arrived still counts.
        if limit is None or self._live.numel + target.numel <= limit:
            self._gather(target, prefetch=True)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.reducer.remove_hooks()

    def __repr__(self) -> str:
        return f"ParameterGatherer(units={len(self.units)}, resident_buckets={len(self.resident_buckets)})"
