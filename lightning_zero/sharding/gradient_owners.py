"""``GradientOwners``: which optimizer steps which elements of each bucket's reduced gradient shard.

Note [gradients of several optimizers]
Several optimizers may step after one backward (manual optimization: a GAN's generator and discriminator, a body
and a head with their own learning rates). At stages 1 and 2 each ``ZeroOptimizer`` flattens its own parameters
and reduces them with a reducer of its own. At stage 3 the model's units are sharded before any optimizer exists,
so every optimizer shares the model's one reducer, and a unit's bucket may hold parameters of several of them.
Each optimizer therefore *claims* the elements of this rank's shard it steps (its segments), and:

- its step consumes, and its ``zero_grad`` clears, only what it claimed. A bucket every claimant has consumed since
  the bucket's last reduction is consumed whole (no memset: stage 2's lazy zero, stage 1's in-place shard); in a
  bucket another claimant has not consumed yet, only the optimizer's own elements are zeroed, so the other keeps
  its gradient for its own step (in any order of the steps, with a ``zero_grad`` of one between them) and an
  optimizer that skips a step accumulates over the next backward, as torch's gradients do;
- a bucket no optimizer claims (parameters of no optimizer) is consumed by every step, as nobody reads it.

Every claimant's own gradient is then exactly what it would be with the bucket to itself. Which buckets are
consumed whole is decided from the order of reductions, steps and ``zero_grad`` calls, which every rank makes
alike, so ranks agree (the next reduction of a bucket adds to it or overwrites it on every rank). The overflow vote
(fp16) and gradient presence (Note [unused parameters]) stay per optimizer: each reads its own elements only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lightning_zero.sharding.flat_bucket import FlatBucket

Span = tuple[int, int]
"""``[start, stop)`` within a bucket's shard on this rank."""


class GradientOwners:
    """Per bucket of one reducer: each claimant's spans, and which claimants have not consumed its gradient since
    the bucket was last reduced (Note [gradients of several optimizers])."""

    def __init__(self, buckets: Sequence[FlatBucket]) -> None:
        self._spans: list[dict[int, list[Span]]] = [{} for _ in buckets]
        self._owed: list[set[int]] = [set() for _ in buckets]
        self._next = 0

    def claim(self, buckets: Sequence[FlatBucket], spans: Iterable[tuple[FlatBucket, int, int]]) -> int:
        """Register a new claimant of ``buckets`` stepping ``spans`` (bucket, start, stop) of them; returns its id.
        A bucket may have no span on this rank (the claim is the same on every rank)."""
        owner = self._next
        self._next += 1
        for bucket in buckets:
            self._spans[bucket.index][owner] = []
            self._owed[bucket.index].add(owner)
        for bucket, start, stop in spans:
            self._spans[bucket.index][owner].append((start, stop))
        return owner

    def spans(self, bucket: FlatBucket) -> dict[int, list[Span]]:
        """Each claimant's spans of ``bucket``."""
        return self._spans[bucket.index]

    def reduced(self, bucket: FlatBucket) -> None:
        """A reduction adds to (or overwrites) the bucket: every claimant has a gradient there to consume."""
        self._owed[bucket.index] = set(self._spans[bucket.index])

    def release(self, owner: int | None, buckets: Sequence[FlatBucket]) -> tuple[list[FlatBucket], list[FlatBucket]]:
        """``owner`` (None: every claimant) is done with its gradients. Returns the buckets now done with whole,
        and those where only ``owner``'s spans are to be zeroed (another claimant still owes its step; not when
        ``owner`` already zeroed them since the bucket's last reduction)."""
        whole: list[FlatBucket] = []
        partial: list[FlatBucket] = []
        for bucket in buckets:
            claims, owed = self._spans[bucket.index], self._owed[bucket.index]
            if owner is None or not claims:
                whole.append(bucket)
                owed.clear()
            elif owner in claims:
                zero = owner not in owed  # consumed since the bucket's last reduction: its spans are zero already
                owed.discard(owner)
                if not owed:
                    whole.append(bucket)
                elif not zero:
                    partial.append(bucket)
        return whole, partial


def local_gradients_error(bucket: FlatBucket) -> RuntimeError:
    """A ``zero_grad`` of one optimizer cannot clear its part of gradients accumulated locally, not yet reduced."""
    return RuntimeError(
        f"zero_grad() of one optimizer while {bucket}, which holds parameters of several optimizers, has gradients "
        "accumulated without synchronization (inside no_sync) and not yet reduced: ZeRO cannot clear one "
        "optimizer's part of them, and the other optimizer's would be lost. HINT: step or zero_grad after a backward "
        "that synchronizes, or use ZeroStrategy(grad_accumulation='sharded'), which reduces every backward."
    )
