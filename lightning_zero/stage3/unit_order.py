"""``UnitOrder``: the order in which a pass (forward or backward) uses the stage-3 units, for prefetching.

Note [forward order]
Prefetching needs to know which unit runs next. Until the first backward ends, the order of first pre-forward calls
is recorded (forward prefetches along it) and so is the order of first post-forward calls: backward runs roughly in
reverse of the latter (the root unit finishes its forward last and starts backward first), so backward prefetches
along that reversed order, skipping units autograd will not reach. Every rank records the same order once units
whose use depends on the data are merged (Note [data-dependent units] in ``divergence.py``); nothing is prefetched
before the order is known.

Each unit's place in an order is kept in a dict, so finding the units after one costs the same whatever the number
of units (a prefetch used to search and copy the whole order: O(units) per unit, O(units²) per step).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator


class UnitOrder:
    """Unit indices in the order a pass first reaches them; ``reverse``: the order is the reverse of the recorded
    one (backward's, from the order in which forwards finish)."""

    def __init__(self, reverse: bool = False) -> None:
        self.reverse = reverse
        self._recorded: list[int] = []
        self._position: dict[int, int] = {}

    def record(self, index: int) -> None:
        """Note the unit's first use (later ones keep its place)."""
        if index not in self._position:
            self._position[index] = len(self._recorded)
            self._recorded.append(index)

    def __contains__(self, index: object) -> bool:
        return index in self._position

    def __iter__(self) -> Iterator[int]:
        return reversed(self._recorded) if self.reverse else iter(self._recorded)

    def following(self, index: int, only: Collection[int] | None = None) -> Iterator[int]:
        """The units after ``index`` in this order (none if it is not in it), those in ``only`` if given. Lazy:
        the caller pays for the units it looks at and those skipped on the way, not for the whole order."""
        position = self._position.get(index)
        if position is None:
            return
        positions = range(position - 1, -1, -1) if self.reverse else range(position + 1, len(self._recorded))
        for p in positions:
            candidate = self._recorded[p]
            if only is None or candidate in only:
                yield candidate

    def remove(self, indices: Collection[int]) -> None:
        """Drop ``indices`` (units merged into others: Note [data-dependent units])."""
        kept = [i for i in self._recorded if i not in indices]
        self._recorded = kept
        self._position = {index: p for p, index in enumerate(kept)}

    def __repr__(self) -> str:
        return f"UnitOrder({list(self)})"
