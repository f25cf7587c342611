"""``StateTiers``: the memory tiers as the optimizer sees them (implemented by ``lightning_zero.offload``).

The optimizer only calls these hooks (Note [tiered step]); where the masters, optimizer state and gradient shards go,
and how they move, is the tiers' business.

Note [tiered step]
With memory tiers (``ZeroConfig.offload_optimizer``, ``lightning_zero.offload``) the masters and optimizer state of
some buckets live in host memory or on disk between steps, and at stage 3 with the disk tier so do their reduced
gradient shards. The step then always runs in chunks, one bucket at a time (Note [step in chunks]): the tiers load
the bucket's masters, state and gradients (read ahead while the previous bucket is stepped), the user's optimizer
steps them, and the tiers write back what changed (in the background) before the next bucket. Gradients of buckets
held in a tier never become ``master.grad`` outside the step; loss scaling (``gradients_reduced``: their overflow
check and unscaling) and clipping (``gradient_norms``, ``set_gradient_transform``) reach them through the tiers
(Note [gradients on disk] in ``offload/tiered_grad_reducer.py``).

Nothing reads a tiered bucket's masters, optimizer state or parameter shard outside ``load``/``unload``: between
them a tensor in a tier has no memory (Note [swap lifecycle] in ``offload/tensor_swapper.py``). So the edit check
(Note [edits reach the masters]) runs per bucket inside its window, as do the step and the copy into the shard;
unscaling and clipping read only gradients in memory (tiered ones through the tiers, as above); an update of the
masters' own state outside the step (``ShardedEMA``) loads just the masters and the entries it names; a swap of
the whole model loads everything (``MemoryTiers.load_all``), and so does ``state_dict()``, which returns copies;
checkpoints read and write the tier entries by range. Only code of the user's that reads masters or optimizer state
by itself (a step hook on the optimizer) must hold them in memory: ``ZeroStrategy.shards_in_memory()``.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from typing import Protocol, TypeVar

from torch import Tensor

from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_groups import MasterRun, Segment

OptimizerT = TypeVar("OptimizerT", contravariant=True)
"""The optimizer the tiers attach to: ``ZeroOptimizer``, which imports this file (``StateTiers[ZeroOptimizer]``), so
this file does not name it."""


class TierStep(enum.Enum):
    """Who steps a bucket the tiers have loaded, and when its new values are published (Note [host step threads]
    and Note [delayed parameter update] in ``offload/``)."""

    GENERIC = "generic"
    """The user's ``optimizer.step()`` on the bucket's narrowed param groups, now."""
    STARTED = "started"
    """The tiers' own step has started (maybe on a worker thread); published once the next bucket has started."""
    DEFERRED = "deferred"
    """The tiers' own step runs while the next forward and backward do; published at the next step (or when the
    optimizer settles)."""


class StateTiers(Protocol[OptimizerT]):
    """The memory tiers as the optimizer sees them (``lightning_zero.offload``): masters, optimizer state and (stage
    3) gradient shards of some buckets live in a tier between steps; the step loads each bucket's around its update
    (Note [tiered step])."""

    def masters_for(
        self, buckets: Sequence[FlatBucket], segments: Sequence[Segment], fp32: bool
    ) -> tuple[list[Tensor], list[MasterRun]]:
        """Place the buckets in the tiers and build every segment's master (in ``segments`` order) where its bucket
        lives, as ``param_groups.masters_for`` does in memory; a master the tiers copy to and from the parameter
        shard themselves (the host tier's) is in no run."""
        ...

    def attach(self, optimizer: OptimizerT) -> None:
        """Take over the tiered buckets' masters and state (called once, at the end of construction)."""
        ...

    def holds_gradient(self, bucket: FlatBucket) -> bool:
        """Whether ``bucket``'s reduced gradient shard is in the tier rather than in memory."""
        ...

    def gradient_norms(self, norm_type: float) -> list[Tensor]:
        """Per tiered-gradient segment that got a gradient: its norm (fp32), read in one pass over the tier."""
        ...

    def gradients_reduced(self, found: Tensor, inv_scale: float | None) -> None:
        """The step's gradients are reduced (once per step, before clipping). With loss scaling (``inv_scale``):
        add to ``found`` (one element) a non-zero count if a tiered gradient is not finite, and unscale the tiered
        gradients as the step and the norm pass read them."""
        ...

    def set_gradient_transform(self, coefficient: Tensor | None, clamp: float | None) -> None:
        """Scale (clip by norm) or clamp (clip by value) the tiered gradients as the step reads them."""
        ...

    def load(self, bucket: FlatBucket, only: Collection[str] | None = None) -> None:
        """Make the bucket's masters, optimizer state and, in a step, tiered gradients usable (``.grad`` set).
        ``only``: an update of the masters' own state outside the step (``ShardedEMA``): just the masters and the
        optimizer-state entries of these names, nothing read ahead (Note [tiered step])."""
        ...

    def start_step(self, bucket: FlatBucket) -> TierStep:
        """After ``load``: step the bucket with the tiers' own kernels if they cover it, or leave it to the
        optimizer (``GENERIC``)."""
        ...

    def finish_step(self, bucket: FlatBucket) -> None:
        """Before the bucket is published: its step (started by ``start_step``, if any) has landed."""
        ...

    def in_flight(self) -> Collection[int]:
        """ids of the buckets whose deferred step has not been published yet."""
        ...

    def unload(self, bucket: FlatBucket) -> None:
        """Put them back into their tier (written if changed)."""
        ...

    def end_step(self) -> None: ...

    def load_all(self) -> None:
        """Every tiered bucket's masters and optimizer state usable at once (outside the step: no gradients)."""
        ...

    def unload_all(self) -> None: ...

    def new_state(self, master: Tensor, name: str) -> Tensor | None:
        """An element-wise optimizer-state tensor ``name`` for ``master`` that lives in the tier from the start (a
        checkpoint load writes its values there), or None when ``master``'s state is kept in memory."""
        ...
