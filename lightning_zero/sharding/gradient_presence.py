"""``GradientPresence``: which parameters of an optimizer got a gradient, on any rank, since its last step.

Note [unused parameters]
As DDP with ``find_unused_parameters=True`` and plain torch: a parameter that got no gradient on any rank since the
last step keeps ``.grad = None`` on its master, so the wrapped optimizer skips it (no step count, no weight decay,
no momentum); one used on some ranks only is averaged over all ranks (the others add zeros), as DDP averages. Each
rank records which of its parameters got a gradient (during every backward since the last step: the reducer's one
hook per parameter sets a byte, ``GradientReducer.present``), and the flags are summed across ranks in one
all-reduce per step, together with the fp16 overflow flag: 4 bytes per parameter tensor of the optimizer, a
latency-bound collective (0.6 ms for the 52 tensors of ``GPTConfig.small`` on two gloo CPU ranks; a 7B model's ~300
tensors are 1.2 kB). Every rank therefore skips the same parameters; a step with no gradient anywhere is a no-op.

Reading the sum is a host synchronization (on a GPU the CPU would wait for the whole backward before it could run
ahead into the next forward), and it is needed only by a rank that lacks a gradient: a parameter that got one here
got one on some rank, whatever the others saw. So a rank whose every parameter got a gradient (every step of most
models) decides "all used" from its own flags and never reads the sum; only a rank that saw a parameter without one
(an unused branch, an expert no token of its batch was routed to) reads it. Every rank still issues the all-reduce,
so the collectives pair whatever each rank reads, and the decision is the same on every rank. Under ``16-mixed`` the
overflow flag must be read anyway: that one read decides both.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_arrivals import GradientArrivals


class GradientPresence:
    """One flag per trainable parameter (those whose ``id`` is in ``trainable``), in the same order on every rank
    (bucket order, then slot order), read from the reducer's ``present`` bytes (``arrivals`` numbers them)."""

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        trainable: Collection[int],
        present: bytearray,
        arrivals: GradientArrivals,
    ) -> None:
        flagged = [(b, i) for b in buckets for i, p in enumerate(b.params) if id(p) in trainable]
        self._flag_of = {(id(b), i): k for k, (b, i) in enumerate(flagged)}
        self._present = present
        self._positions = [arrivals.position(b.index, i) for b, i in flagged]
        """Where each flag's byte is in ``present``."""
        self._everything = self._positions == list(range(len(present)))
        """Whether this optimizer's flags are all of ``present``, in order (one optimizer over the whole model)."""
        self._counts: list[float] | None = [0.0] * len(flagged)
        """How many ranks had a gradient for each parameter, as last ``decide``d; None: every one had one here."""

    def local_flags(self, device: torch.device) -> Tensor:
        """This rank's flags as 0/1 float32, to be summed over ranks and passed to ``decide``."""
        if self._everything:
            flags = torch.frombuffer(self._present, dtype=torch.uint8).to(torch.float32) if self._present else None
        else:
            flags = None
        if flags is None:
            flags = torch.tensor([self._present[p] for p in self._positions], dtype=torch.float32)
        if device.type != "cuda":
            return flags.to(device)
        # From pinned memory without blocking: a copy from pageable memory waits for the stream to drain, a host
        # synchronization every step (seen in scripts/gpu_check.sh's profile on an H100). Pinned blocks are reused
        # only once the copy is done (torch's caching host allocator records it).
        return flags.pin_memory().to(device, non_blocking=True)

    def all_arrived_here(self) -> bool:
        """Whether every parameter got a gradient on this rank: then each got one on some rank, and the sum need
        not be read (Note [unused parameters])."""
        if self._everything:
            return 0 not in self._present
        return all(self._present[p] for p in self._positions)

    def decide(self, counts: Sequence[float] | None) -> None:
        """Take the flags summed over ranks; None: every parameter got a gradient on this rank."""
        self._counts = None if counts is None else list(counts)

    @property
    def any(self) -> bool:
        """Whether any parameter got a gradient on any rank (as last decided)."""
        if self._counts is None:
            return bool(self._positions)
        return any(count > 0 for count in self._counts)

    def used(self, bucket: FlatBucket, slot: int) -> bool:
        """Whether the parameter in ``slot`` of ``bucket`` got a gradient on any rank (as last decided)."""
        return self._counts is None or self._counts[self._flag_of[(id(bucket), slot)]] > 0

    def swap_local(self, flags: bytes | None = None) -> bytes:
        """This rank's flags, replaced by ``flags`` (None: cleared); to see what one backward brings (Note [gradients
        between backward and step] in ``fabric/visible_gradients.py``)."""
        taken = bytes(self._present[p] for p in self._positions)
        for k, p in enumerate(self._positions):
            self._present[p] = 0 if flags is None else flags[k]
        return taken

    def reset(self) -> None:
        """Forget this rank's flags (after a step, or ``zero_grad``)."""
        if self._everything:
            self._present[:] = bytes(len(self._present))
            return
        for p in self._positions:
            self._present[p] = 0
