"""``ShardedParameters``: a model whose parameters are sharded as well (stage 3), as the optimizer sees it.

``ZeroOptimizer`` and the checkpoints take any object with this protocol, so this package knows nothing of stage 3.
"""

from __future__ import annotations

from typing import Protocol

from lightning_zero.comm.ledger import CommLedger
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_reducer import GradientReducer


class ShardedParameters(Protocol):
    """A model whose parameters are sharded as well (stage 3's ``ParameterGatherer``), as the optimizer sees it:
    it owns the gradient reducer and the ledger of the step, and is told when the shards have changed."""

    @property
    def ledger(self) -> CommLedger: ...

    @property
    def reducer(self) -> GradientReducer: ...

    def all_buckets(self) -> list[FlatBucket]:
        """Every bucket of the sharded model, frozen and resident ones included."""
        ...

    def refresh_gathered(self) -> None:
        """Re-gather whatever is gathered right now, so that it reflects the shards."""
        ...
