"""Keeping every rank's stage-3 gathers paired when ranks run different modules.

Note [divergence check]
Before a unit's all-gather, ranks exchange the unit's index. During the first step the exchange is awaited before
the gather is issued and its answer decides what is gathered (Note [data-dependent units]). Afterwards the exchange
is issued with the gather and compared when the unit is used or freed: a gather the module needs right now waits for
it before issuing the gather itself, so ranks that went different ways get an error naming both units before any
mismatched collective is issued; a prefetch does not wait (waiting would turn every prefetch into a barrier with the
slowest rank, ~55 ms of a 2 s step on the benchmark GPT). Reading the answer is a host synchronization, which on a
GPU stops the CPU from running ahead: after the first step the check is therefore on by default for CPU devices
only (``ZeroConfig.check_rank_divergence``), where it costs a few microseconds per unit.

Note [data-dependent units]
A module that one rank calls and another skips must not be a unit of its own, or the ranks' gathers part ways. The
experts of a mixture are found from the module tree before any step and never split (Note [leaf modules] in
``wrap_policy.py``); this note is the fallback for other shapes: a unit whose use depends on the data in the first
step, e.g. an expert (one of several same-class modules in a ``ModuleList``, a unit by the default policy) in a
block the leaf rule does not recognize, which one rank's tokens are routed to and another's are not. During the
first step every gather is a *round*: ranks exchange the unit each wants and all of them gather every unit asked
for, in index order, so their collectives stay paired even though they asked for different units; a rank that has
its unit already (gathered in an earlier round) asks for nothing until it needs a collective, and at the end of the
forward and of the backward every rank keeps answering rounds until all are done. A unit asked for by some ranks but
not by others in the same round is *data-dependent*: at the end of the first forward it and its siblings (the units
in the same container, e.g. every expert of that layer) are merged into the nearest enclosing unit, which gathers
them with its own parameters from then on. Every rank then gathers the same units in the same order whatever the
routing, and a merged unit's own hooks do nothing. Gradients are unaffected: an expert a rank did not use
contributes zeros to the reduction, as under DDP with ``find_unused_parameters=True``. Two things keep the
collectives paired in backward, where a rank's gradient reductions are issued as its gradients arrive, which now
depends on its data: a merged unit's buckets are reduced when its enclosing unit's backward is over (not when its
gradients have all arrived, which on a rank that skipped it is never), and from the first merge on, gathers run on a
communicator of their own, so that a gather on one rank cannot pair with a reduction on another. Every rank still
issues the two in one interleaving (Note [one order of collectives] in ``comm/streams.py``). Routing that parts
ways only after the first step cannot be foreseen here: the later check (Note [divergence check]) stops it with the
module to declare a leaf.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.comm.collectives import ProcessGroup, all_gather
from lightning_zero.comm.pending_collective import PendingCollective
from lightning_zero.stage3.sharded_unit import ShardedUnit

NOTHING = -1
"""What a rank asks for in a round when it needs no unit (it has reached the end of a forward or backward)."""


class RankDivergenceError(RuntimeError):
    """Ranks ran different modules: their next collectives would not match."""


def _parent_and_container(name: str, names: dict[str, int]) -> tuple[int, str]:
    """The nearest enclosing unit of the unit called ``name`` (0, the root, if none) and the module containing it."""
    parts = name.split(".")
    container = ".".join(parts[:-1])
    for depth in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:depth])
        if candidate in names:
            return names[candidate], container
    return 0, container


class UnitExchange:
    """The index exchanges of one sharded model: first-step rounds, later checks, and the merges they lead to."""

    def __init__(self, units: list[ShardedUnit], group: ProcessGroup, device: torch.device) -> None:
        self.units = units
        self.group = group
        self.device = device
        names = {u.name: u.index for u in units[1:]}
        self._parent: dict[int, int] = {}
        self._container: dict[int, str] = {}
        for unit in units[1:]:
            self._parent[unit.index], self._container[unit.index] = _parent_and_container(unit.name, names)
        self.merged_into: dict[int, int] = {}
        """Merged unit -> the unit that gathers it (Note [data-dependent units])."""
        self.divergent: set[int] = set()
        """Units asked for by some ranks but not others in a round, not merged yet."""
        self._checks: dict[int, tuple[PendingCollective, torch.Tensor]] = {}

    # -- first step: rounds -----------------------------------------------------------------------------------------
    def round(self, wanted: int) -> list[int]:
        """Every rank's wanted unit index (``NOTHING`` for none), in rank order; blocks until all have answered."""
        mine = torch.tensor([wanted], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.group.size(), dtype=torch.int64, device=self.device)
        all_gather(everyone, mine, self.group).wait()  # control traffic, not the model's: not in the ledger
        answers: list[int] = everyone.tolist()
        asked = {i for i in answers if i != NOTHING}
        if len(set(answers)) > 1:
            self.divergent |= asked
        return sorted(asked)

    def merge_divergent(self) -> list[int]:
        """Merge each data-dependent unit and its siblings into their enclosing unit; returns the units merged."""
        merged: list[int] = []
        for index in sorted(self.divergent):
            if index == 0 or index in self.merged_into:
                continue
            parent, container = self._parent[index], self._container[index]
            for sibling in self.units[1:]:
                if sibling.index in self.merged_into or sibling.index == parent:
                    continue
                if self._parent.get(sibling.index) == parent and self._container.get(sibling.index) == container:
                    self.merged_into[sibling.index] = self._owner_index(parent)
                    merged.append(sibling.index)
        # A unit that others were merged into may itself be merged later: point everything at the final owner.
        self.merged_into = {child: self._owner_index(owner) for child, owner in self.merged_into.items()}
        self.divergent.clear()
        return merged

    def _owner_index(self, index: int) -> int:
        while index in self.merged_into:
            index = self.merged_into[index]
        return index

    # -- later steps: checks ----------------------------------------------------------------------------------------
    def issue_check(self, unit: ShardedUnit) -> None:
        """Issue the exchange of ``unit``'s index, to be compared by ``verify`` (Note [divergence check])."""
        mine = torch.tensor([unit.index], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.group.size(), dtype=torch.int64, device=self.device)
        self._checks[unit.index] = (all_gather(everyone, mine, self.group), everyone)

    def verify_all(self) -> None:
        for index in list(self._checks):
            self.verify(self.units[index])

    def verify(self, unit: ShardedUnit) -> None:
        """Raise ``RankDivergenceError`` if the exchange issued with ``unit``'s gather shows another unit."""
        check = self._checks.pop(unit.index, None)
        if check is None:
            return
        pending, everyone = check
        pending.wait()
        # One scalar read whatever the world size (a list of every rank's index cost O(world) per unit); the
        # indices are listed only for the error.
        if bool((everyone != unit.index).any()):
            indices = everyone.tolist()
            names = ", ".join(f"rank {r}: {self.units[i].name!r}" for r, i in enumerate(indices))
            leaf = self._leaf_candidate(sorted(set(indices)))
            raise RankDivergenceError(
                f"ZeRO stage 3: ranks are about to gather different units ({names}). Ranks ran different modules "
                f"(rank {self.group.rank()} is at unit {self.units[unit.index].name!r}) after the first step, so "
                "their collectives no longer match. Units whose use depends on the data are found in the first step "
                "and gathered with their enclosing unit from then on; this one was used the same way on every rank "
                "then (a mixture of experts whose routing changed after it?). HINT: make data-dependent branches "
                "agree across ranks (e.g. decide with `strategy.reduce_boolean_decision`), or declare the module "
                f"that chooses between them a leaf, gathered as one unit: `ZeroConfig.leaf_module_classes=({leaf!r},)` "
                "(Note [leaf modules]; a tuple replaces the automatic rule, so list every MoE block class)."
            )

    def _leaf_candidate(self, indices: list[int]) -> str:
        """The class name of the module enclosing the units at ``indices`` (the root excluded) that is not a
        container: the module that chose between them, to suggest as a leaf."""
        root = self.units[0].module
        paths = [self.units[i].name.split(".") for i in indices if i != 0]
        common: list[str] = []
        for parts in zip(*paths, strict=False):
            if len(set(parts)) > 1:
                break
            common.append(parts[0])
        if len(paths) == 1:  # the other ranks are in the root unit: the unit's own parent chose
            common = common[:-1]
        while common and isinstance(root.get_submodule(".".join(common)), (nn.ModuleList, nn.ModuleDict)):
            common.pop()
        return type(root.get_submodule(".".join(common))).__name__
