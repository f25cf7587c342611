"""``OutsideStep``: the gatherer's API for full parameters outside forward and backward.

``gathered()`` gathers units exactly for the caller (a checkpoint, a full-weights read or write, sampling), and the
calls that follow a change of the shards from outside a step (optimizer step, checkpoint load, EMA swap):
``refresh_gathered()``, ``invalidate_secondaries()``, ``release_all()``; and the forwards of calls made outside a step
(Note [one-rank calls] in ``one_rank_calls.py``): met with the other ranks first, and served by them when this rank
calls alone. A mixin of ``ParameterGatherer``, which owns the units' state and the gathers these calls go through.

Note [edits discarded at exit]
``gathered(writeback=False)`` frees the full parameters at exit and the shards keep their values, so a change made
inside it (peft's ``merge_and_unload()``, then ``save_pretrained``, saves the unmerged base weights) would be lost
without a word. Such a change is found at exit and refused. Tensor version counters would be free to read, but they miss
the usual ways of writing a parameter outside autograd (measured: ``p.add_`` under ``no_grad`` moves ``p._version``;
``p.data.add_``, ``p.data.copy_``, ``p.data += delta`` (peft's merge) and ``p.data = tensor`` (peft's ``safe_merge``)
move no counter of the parameter or of the flat buffer it views). So the check is by content: at entry every parameter
of the units this context gathers (and so frees) is digested on its device, the digest of Note [edits reach the masters]
in ``sharding/param_edits.py`` (exact: the same bits give the same digest; any one-element change is seen), and at exit
digested again; a parameter given a new tensor (``p.data = tensor``) is found by its data pointer. Only parameters count
(a KV cache or a buffer a forward updates is no parameter), and only units this context frees: a unit already gathered
(inside its forward, or an outer ``writeback=True``) keeps its edits past this exit. A forward inside the context runs
on the units it holds (``ParameterGatherer._held``: its post-forward and the end of the pass leave them gathered), so an
edit before a forward is seen, and used by it, as under DDP; a bucket freed since entry all the same (a backward inside
the context frees what it reaches: ``FlatBucket.releases``) is not compared. Cost: two passes over the gathered
parameters on the device (about 18 bytes of memory traffic per 2 bytes each, against the all-gather's own traffic), a
1/256 copy kept in between, one host read of one flag per parameter, and one all-reduce of one integer per rank on the
model's group: entry was collective (the gathers), so every rank reaches the exit too, and every rank raises together,
naming the parameters on the ranks that edited them and those ranks on the others; a rank raising alone would leave the
others hanging in their next collective. A call one rank makes alone, served by the others (Note [one-rank calls]), has
no peers in step at its exit: that rank warns (``UserWarning``) instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lightning_zero.comm.collectives import ProcessGroup, all_reduce_sum
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.compat import current_graph_task_id
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_edits import digest, digest_weights
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
        _held: dict[int, int]

        def _owner(self, unit: ShardedUnit) -> ShardedUnit: ...
        def _gather(self, unit: ShardedUnit, prefetch: bool = False, exact: bool = False) -> None: ...
        def _wait(self, unit: ShardedUnit) -> None: ...
        def _release(self, unit: ShardedUnit, reuse: bool = False) -> None: ...

    @contextmanager
    def gathered(self, module: nn.Module | None = None, writeback: bool = False) -> Iterator[None]:
        """Gather the full parameters of ``module`` (default: the whole model) on every rank, collectively.

        With ``writeback=True`` changes made to the parameters inside the context are kept (each rank keeps its own
        shard of the result); otherwise they are discarded, and a change found at exit raises on every rank (Note
        [edits discarded at exit]). The sharded state is restored in every case. The values
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
        unwritten: _Unwritten | None = None
        edited: list[str] = []
        try:
            for unit in newly:
                if served:
                    self._served_gather(unit)
                else:
                    self._held[unit.index] = self._held.get(unit.index, 0) + 1  # a forward inside keeps it
                    self._gather(unit, exact=True)
            for unit in units:
                if not served:
                    self._wait(unit)
            if not writeback and newly:  # Note [edits discarded at exit]
                unwritten = _Unwritten([b for u in newly for m in (u, *self._children[u.index]) for b in m.buckets])
            yield
            if unwritten is not None:
                edited = unwritten.edited()
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
                    self._held[unit.index] -= 1
                    self._release(unit)
        if unwritten is not None:
            self._refuse_discarded(edited, served, unwritten.device)

    def _refuse_discarded(self, edited: list[str], served: bool, device: torch.device) -> None:
        """Raise on every rank if any rank changed parameters this ``gathered(writeback=False)`` discarded; warn on
        a served lone caller (Note [edits discarded at exit])."""
        fix = (
            "with writeback=False (the default) the full parameters are freed at exit and each rank's shard keeps its "
            "old values. HINT: make the change inside `gathered_parameters(module, writeback=True)` to keep it (e.g. "
            "peft's `merge_and_unload()` before `save_pretrained`)."
        )
        named = ", ".join(repr(name) for name in edited[:8]) + (
            f" and {len(edited) - 8} more" if len(edited) > 8 else ""
        )
        if served:
            if edited:
                warnings.warn(
                    f"gathered_parameters() discarded the changes made inside it to {named}: {fix}", stacklevel=4
                )
            return
        group = self.gather_group
        counts = torch.zeros(group.size(), dtype=torch.int64, device=device)
        counts[group.rank()] = len(edited)
        all_reduce_sum(counts, group).wait()
        per_rank = counts.tolist()  # one host read, outside any step
        if not any(per_rank):
            return
        if edited:
            raise RuntimeError(
                f"gathered_parameters() discarded the changes this rank (rank {group.rank()}) made inside it to "
                f"{named}: {fix}"
            )
        ranks = ", ".join(str(r) for r, n in enumerate(per_rank) if n)
        raise RuntimeError(
            f"gathered_parameters() discarded the changes rank(s) {ranks} made inside it to "
            f"{sum(per_rank)} parameter(s) (named in those ranks' errors): {fix}"
        )

    def release_all(self, keep: ShardedUnit | None = None) -> None:
        """Free every unit that is not inside its forward or a ``gathered()`` context (except ``keep``)."""
        for unit in self.units:
            held = self._depth[unit.index] or self._held.get(unit.index)  # inside its forward, or by gathered()
            if self._owner(unit) is unit and not held and unit is not keep:
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
            if self._depth[unit.index] > 0 or self._held.get(unit.index):
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


class _Unwritten:
    """The parameters of the buckets a ``gathered(writeback=False)`` frees at exit, digested at entry, to find
    those changed inside it (Note [edits discarded at exit])."""

    def __init__(self, buckets: list[FlatBucket]) -> None:
        self.buckets = buckets
        self.device = buckets[0].device
        self._weights: dict[torch.device, Tensor] = {}
        self._releases = [bucket.releases for bucket in buckets]
        self._before = [self._digests(bucket) for bucket in buckets]

    def _digests(self, bucket: FlatBucket) -> list[Tensor | None]:
        flat = bucket.data
        assert flat is not None
        if flat.device not in self._weights:
            self._weights[flat.device] = digest_weights(flat.device)
        weights = self._weights[flat.device]
        return [digest(bucket.param_view(flat, s), weights) if s.numel else None for s in bucket.slots]

    def edited(self) -> list[str]:
        """The names of the parameters changed since entry: one host read."""
        moved: list[str] = []
        names: list[str] = []
        differs: list[Tensor] = []
        for bucket, before, releases in zip(self.buckets, self._before, self._releases, strict=True):
            if bucket.releases != releases or bucket.data is None:
                continue  # freed inside the context (by a forward): what was gathered at entry is gone
            base, size = bucket.data.data_ptr(), bucket.data.element_size()
            after = self._digests(bucket)
            for (slot, param), old, new in zip(bucket.slots_and_params(), before, after, strict=True):
                if old is None or new is None:
                    continue
                if param.data_ptr() != base + slot.offset * size:  # `param.data = tensor`
                    moved.append(slot.fqn)
                    continue
                names.append(slot.fqn)
                differs.append((old != new).any())
        changed = torch.stack(differs).tolist() if differs else []
        return moved + [name for name, change in zip(names, changed, strict=True) if change]
