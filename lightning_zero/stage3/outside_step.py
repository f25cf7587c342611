"""``OutsideStep``: the gatherer's API for full parameters outside forward and backward.

``gathered()`` gathers units exactly for the caller (a checkpoint, a full-weights read or write, sampling), and the
calls that follow a change of the shards from outside a step (optimizer step, checkpoint load, EMA swap):
``refresh_gathered()``, ``invalidate_secondaries()``, ``release_all()``; and the forwards of calls made outside a step
(Note [one-rank calls] in ``one_rank_calls.py``): met with the other ranks first, and served by them when this rank
calls alone. A mixin of ``ParameterGatherer``, which owns the units' state and the gathers these calls go through.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zero.comm.collectives import ProcessGroup
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.compat import current_graph_task_id
from lightning_zero.stage3.one_rank_calls import OneRankCalls
from lightning_zero.stage3.sharded_unit import ShardedUnit, UnitState

__all__ = ["OutsideStep"]


class OutsideStep:
    """Gathering and freeing units outside forward and backward: mixed into ``ParameterGatherer``."""

    if TYPE_CHECKING:  # provided by ParameterGatherer
        root: nn.Module
        units: list[ShardedUnit]
        _children: dict[int, list[ShardedUnit]]
        _depth: dict[int, int]
        calls: OneRankCalls | None
        gather_group: ProcessGroup
        _call_depth: int
        _served_depth: dict[int, int]

        def _owner(self, unit: ShardedUnit) -> ShardedUnit: ...
        def _gather(self, unit: ShardedUnit, prefetch: bool = False, exact: bool = False) -> None: ...
        def _wait(self, unit: ShardedUnit) -> None: ...
        def _release(self, unit: ShardedUnit, reuse: bool = False) -> None: ...

    @contextmanager
    def gathered(self, module: nn.Module | None = None, writeback: bool = False) -> Iterator[None]:
        """Gather the full parameters of ``module`` (default: the whole model) on every rank, collectively.

        With ``writeback=True`` changes made to the parameters inside the context are kept (each rank keeps its own
        shard of the result); otherwise they are discarded. The sharded state is restored in every case. The values
        are the shards' own, gathered exactly also under qwZ (its int8 gather would hand out rounded weights, and
        write them back); a unit already gathered by a quantized forward gather cannot be written back.
        """
        wanted = {id(p) for p in (module or self.root).parameters()}
        members = [u for u in self.units if any(id(p) in wanted for b in u.buckets for p in b.params)]
        units = list({self._owner(u).index: self._owner(u) for u in members}.values())
        newly = [u for u in units if u.state is UnitState.SHARDED]
        rounded = [u.name for u in units if u not in newly and u.gather_comm.lossy]
        if writeback and rounded:
            raise RuntimeError(
                f"gathered_parameters(writeback=True) on units that hold qwZ's quantized weights from their forward "
                f"gather ({', '.join(rounded)}): writing them back would round the shards to int8 blocks. HINT: call "
                "it outside forward and backward (e.g. after the optimizer step), or with "
                "reshard_root_after_forward=True so that no unit stays gathered past its forward."
            )
        served = self.calls is not None and self.calls.served  # Note [one-rank calls]
        try:
            for unit in newly:
                if served:
                    self._served_gather(unit)
                else:
                    self._gather(unit, exact=True)
            for unit in units:
                if not served:
                    self._wait(unit)
            yield
            if writeback:
                with torch.no_grad():
                    for bucket in (b for u in units for m in (u, *self._children[u.index]) for b in m.buckets):
                        assert bucket.data is not None
                        bucket.reattach()  # a `param.data = tensor` inside the context is written back too
                        bucket.param_shard.copy_(bucket.shard_of(bucket.data))
                self.invalidate_secondaries()
        finally:
            for unit in newly:
                if served:
                    self._served_release(unit)
                else:
                    self._release(unit)

    def release_all(self, keep: ShardedUnit | None = None) -> None:
        """Free every unit that is not inside its forward (except ``keep``)."""
        for unit in self.units:
            if self._owner(unit) is unit and self._depth[unit.index] == 0 and unit is not keep:
                self._release(unit)

    def invalidate_secondaries(self) -> None:
        """The primary shards may have been written, on every rank together: no hpZ secondary shard made before
        serves a gather again (Note [secondary shards] in ``secondary_shard.py``)."""
        for unit in self.units:
            unit.gather_comm.invalidate()

    def refresh_gathered(self) -> None:
        """After the shards changed (optimizer step, checkpoint load, EMA swap): drop the hpZ secondary shards, free
        idle units, re-gather those inside their forward (a manual-optimization ``training_step`` that steps and
        then keeps using the model)."""
        self.invalidate_secondaries()
        for unit in self.units:
            if unit.state is UnitState.SHARDED or self._owner(unit) is not unit:
                continue
            self._release(unit)
            if self._depth[unit.index] > 0:
                self._gather(unit)
                self._wait(unit)

    # -- calls outside a step: Note [one-rank calls] in one_rank_calls.py ---------------------------------------------
    def attach_calls(self, calls: OneRankCalls) -> None:
        """Meet the other ranks before calls outside a step, and serve a lone caller's unit gathers."""
        self.calls = calls
        calls.handlers["unit"] = lambda index: self._serve(self.units[index])

    def _call_pre_forward(self, unit: ShardedUnit) -> bool:
        """Before ``pre_forward``: begin a call if this forward starts one; True if this rank's call is served (the
        gather is done here)."""
        calls = self.calls
        assert calls is not None
        if self._call_depth:  # inside a call a forward began
            self._call_depth += 1
        elif calls.active or torch.is_grad_enabled() or current_graph_task_id() != -1 or any(self._depth.values()):
            return False  # a step, a forward with gradients (training), a recomputation, or inside a forward
        else:
            calls.begin("a forward without gradients")
            self._call_depth = 1
        if not calls.served:
            return False
        self._served_gather(unit)
        return True

    def _call_post_forward(self, unit: ShardedUnit) -> bool:
        """Before ``post_forward``: end the call if this forward began it; True if it was served (released here)."""
        calls = self.calls
        if not self._call_depth or calls is None:
            return False
        self._call_depth -= 1
        served = calls.served
        if served:
            self._served_release(unit)
        if self._call_depth == 0:
            calls.end()
        return served

    def _served_gather(self, unit: ShardedUnit) -> None:
        """Gather ``unit`` (with the units merged into it) exactly, asking the waiting ranks to take part."""
        owner = self._owner(unit)
        self._served_depth[owner.index] = self._served_depth.get(owner.index, 0) + 1
        if self._served_depth[owner.index] == 1 and owner.state is UnitState.SHARDED:
            assert self.calls is not None
            self.calls.collective("unit", owner.index)
            self._serve(owner, keep=True)

    def _served_release(self, unit: ShardedUnit) -> None:
        owner = self._owner(unit)
        self._served_depth[owner.index] -= 1
        if self._served_depth[owner.index] == 0:
            for member in (owner, *self._children[owner.index]):
                member.release()

    def _serve(self, unit: ShardedUnit, keep: bool = False) -> None:
        """The collective of a served gather, the same on the caller (``keep``: the parameters are used) and on each
        waiting rank (released at once)."""
        members = (unit, *self._children[unit.index])
        ledger = CommLedger()  # not a step's traffic
        for member in members:
            member.gather(self.gather_group, ledger, exact=True)
        for member in members:
            member.wait()
            if not keep:
                member.release()
