"""``LaunchOrder``: the order a gradient reducer launches its buckets in, and how far the current round has got.

Buckets are launched strictly in one order on every rank: registration order at first, then the order rank 0 saw
them complete in the first backward that reduces (Note [bucket order] in ``flat_bucket.py``). Within a round a bucket
is never launched ahead of an earlier one; the end-of-backward flush (Note [bucket flush] in ``gradient_reducer.py``)
launches the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import ProcessGroup
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_arrivals import GradientArrivals


class LaunchOrder:
    """One reducer's bucket order (Note [bucket order]) and its position in the current round."""

    def __init__(self, buckets: Sequence[FlatBucket]) -> None:
        self.buckets = list(buckets)
        """The order buckets are reduced in: registration order at first, then the observed one."""
        self._next = 0
        """Position in ``buckets`` of the next bucket to launch in the current round."""
        self._observed: list[int] | None = []
        """Bucket indices whose gradients completed in the first backward; None once applied. They are ordered by
        their last gradient's arrival (``arrivals.last_call``)."""

    def upcoming(self) -> FlatBucket | None:
        """The next bucket to launch in this round; None once every one was."""
        return self.buckets[self._next] if self._next < len(self.buckets) else None

    def advance(self) -> None:
        """The upcoming bucket was launched."""
        self._next += 1

    def remaining(self) -> list[FlatBucket]:
        """The buckets this round has not launched yet, in order."""
        return self.buckets[self._next :]

    def restart(self) -> None:
        """A new round starts from the first bucket."""
        self._next = 0

    def observe(self, bucket: FlatBucket) -> None:
        """``bucket``'s gradients completed (counted or declared): recorded in the first reducing backward."""
        if self._observed is not None and bucket.index not in self._observed:
            self._observed.append(bucket.index)

    def adopt_observed(self, arrivals: GradientArrivals, group: ProcessGroup) -> None:
        """After the first reducing backward, launch buckets in the order rank 0 saw them complete; every rank takes
        rank 0's, so the reductions still pair up. The same collective maxes each parameter's gradient count over
        ranks (Note [final gradients] in ``gradient_arrivals.py``)."""
        if self._observed is None or not self.buckets:
            return
        nb = len(self.buckets)
        calls = arrivals.calls()
        exchanged = torch.full((nb + calls.numel(),), -1, dtype=torch.int64)
        if group.rank() == 0:  # the others' -1 leave rank 0's order under the max
            order = sorted(self._observed, key=lambda i: arrivals.last_call[i])
            exchanged[: len(order)] = torch.tensor(order, dtype=torch.int64)
        exchanged[nb:] = calls
        if group.size() > 1:
            exchanged = exchanged.to(self.buckets[0].device)
            dist.all_reduce(exchanged, op=dist.ReduceOp.MAX, group=group)
        values = exchanged.tolist()
        arrivals.learn(values[nb:])
        first = [i for i in values[:nb] if i >= 0]
        by_index = {b.index: b for b in self.buckets}
        self.buckets = [by_index[i] for i in first] + [b for b in self.buckets if b.index not in first]
        self._observed = None
