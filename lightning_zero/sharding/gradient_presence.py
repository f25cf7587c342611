"""``GradientPresence``: which parameters of an optimizer got a gradient, on any rank, since its last step.

Note [unused parameters]
As DDP with ``find_unused_parameters=True`` and plain torch: a parameter that got no gradient on any rank since the
last step keeps ``.grad = None`` on its master, so the wrapped optimizer skips it (no step count, no weight decay,
no momentum); one used on some ranks only is averaged over all ranks (the others add zeros), as DDP averages. Each
rank records which of its parameters' gradient hooks fired (during every backward since the last step), and the
flags are summed across ranks in one all-reduce per step, together with the fp16 overflow flag: 4 bytes per
parameter tensor of the optimizer, a latency-bound collective (0.6 ms for the 52 tensors of ``GPTConfig.small`` on
two gloo CPU ranks; a 7B model's ~300 tensors are 1.2 kB).
Every rank therefore skips the same parameters; a step with no gradient anywhere is a no-op.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial

import torch
from torch import Tensor

from lightning_zero.sharding.flat_bucket import FlatBucket


class GradientPresence:
    """One flag per trainable parameter (those whose ``id`` is in ``trainable``), in the same order on every rank
    (bucket order, then slot order), set by a hook when its gradient is accumulated."""

    def __init__(self, buckets: Sequence[FlatBucket], trainable: Collection[int]) -> None:
        flagged = [(b, i) for b in buckets for i, p in enumerate(b.params) if id(p) in trainable]
        self._flag_of = {(id(b), i): k for k, (b, i) in enumerate(flagged)}
        self._arrived = [False] * len(flagged)
        """Whether each parameter got a gradient on this rank since ``reset``."""
        self._counts = [0.0] * len(flagged)
        """How many ranks had a gradient for each parameter, as last ``decide``d."""
        for k, (bucket, i) in enumerate(flagged):
            bucket.params[i].register_post_accumulate_grad_hook(partial(_mark, self._arrived, k))

    def local_flags(self, device: torch.device) -> Tensor:
        """This rank's flags as 0/1 float32, to be summed over ranks and passed to ``decide``."""
        flags = torch.tensor(self._arrived, dtype=torch.float32)
        if device.type != "cuda":
            return flags.to(device)
        # From pinned memory without blocking: a copy from pageable memory waits for the stream to drain, a host
        # synchronization every step (seen in scripts/gpu_check.sh's profile on an H100). Pinned blocks are reused
        # only once the copy is done (torch's caching host allocator records it).
        return flags.pin_memory().to(device, non_blocking=True)

    def decide(self, counts: Sequence[float]) -> None:
        """Take the flags summed over ranks."""
        self._counts = list(counts)

    @property
    def any(self) -> bool:
        """Whether any parameter got a gradient on any rank (as last decided)."""
        return any(count > 0 for count in self._counts)

    def used(self, bucket: FlatBucket, slot: int) -> bool:
        """Whether the parameter in ``slot`` of ``bucket`` got a gradient on any rank (as last decided)."""
        return self._counts[self._flag_of[(id(bucket), slot)]] > 0

    def reset(self) -> None:
        """Forget this rank's flags (after a step, or ``zero_grad``)."""
        self._arrived[:] = [False] * len(self._arrived)


def _mark(flags: list[bool], index: int, param: Tensor) -> None:
    flags[index] = True  # holds the flags, not their owner, so the parameter makes no reference cycle
