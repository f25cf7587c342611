"""``OutsideStep``: the gatherer's API for full parameters outside forward and backward.

``gathered()`` gathers units exactly for the caller (a checkpoint, a full-weights read or write, sampling), and the
calls that follow a change of the shards from outside a step (optimizer step, checkpoint load, EMA swap):
``refresh_gathered()``, ``invalidate_secondaries()``, ``release_all()``. A mixin of ``ParameterGatherer``, which owns
the units' state and the gathers these calls go through.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zero.stage3.sharded_unit import ShardedUnit, UnitState

__all__ = ["OutsideStep"]


class OutsideStep:
    """Gathering and freeing units outside forward and backward: mixed into ``ParameterGatherer``."""

    if TYPE_CHECKING:  # provided by ParameterGatherer
        root: nn.Module
        units: list[ShardedUnit]
        _children: dict[int, list[ShardedUnit]]
        _depth: dict[int, int]

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
        try:
            for unit in newly:
                self._gather(unit, exact=True)
            for unit in units:
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
