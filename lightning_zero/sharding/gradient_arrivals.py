"""``GradientArrivals``: when a bucket's gradients are final in the backward running now.

Note [final gradients]
A bucket may be reduced only once every one of its parameters has received its last gradient of the backward; a
contribution that arrives after the reduce-scatter is issued is lost (stage 1) or needs a second reduction that
the other ranks would not issue (stages 2 and 3). In a plain backward autograd sums every use of a parameter before
accumulating it, so its post-accumulate-grad hook fires once and counting parameters is enough. Under reentrant
activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's default) each
segment's recomputation runs a backward of its own inside the step's, and a parameter used in k segments (weights
shared across depth, as ALBERT's; a looped block), or in a segment and outside one, has its hook fire k times, the
last one possibly long after the first. Hook calls are therefore counted per parameter against the number of calls
that make it final (``expected``), not per bucket:

- The first backward that reduces learns ``expected``: a bucket whose gradients arrive inside a nested backward
  (a hook running under some autograd ``Function``'s ``backward``: ``in_nested_backward``) may get more of them,
  so it is held to the end-of-backward flush (Note [bucket flush] in ``gradient_reducer.py``) instead of being
  launched by count. Every other bucket launches as usual: outside reentrant segments a gradient arrives once.
  The cost is paid once: in that backward the held buckets' full gradients (at stages 2 and 3, every bucket of a
  model checkpointed block by block) wait for the flush instead of being reduced to shards along the way.
- At the end of that backward each parameter's number of calls is maxed over ranks (with the launch order, Note
  [bucket order]), so that every rank expects what any rank saw. From then on a bucket launches as soon as each of
  its parameters has had its expected number of calls: the bucket of a shared block leaves after the block's first
  use has been recomputed (the last one backward reaches), with the reductions of the layers below it overlapping.
  A parameter that gets fewer calls (a branch not taken) is launched by the flush.
- A gradient arriving for a bucket already reduced in this backward (a parameter used in more segments than the
  first backward showed, or first used outside a segment and then inside one) cannot be folded in without a
  reduction the other ranks do not issue: it is an error naming the parameter, never a silent difference. DDP
  refuses every such model (it marks a parameter ready twice); non-reentrant checkpointing hands each parameter
  its whole gradient at once and needs none of this.

Launch timing needs no agreement between ranks while reductions are the only collectives in flight: buckets are
issued in one order everywhere (Note [bucket order]), so a rank that holds a bucket longer only delays the
collectives that follow it. Stage 3 gathers during backward too, and there a bucket is launched only at points every
rank shares (Note [one order of collectives] in ``comm/streams.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType

import torch
from torch.autograd.function import BackwardCFunction

from lightning_zero.sharding.flat_bucket import FlatBucket, ParamSlot

_FUNCTION_BACKWARD = BackwardCFunction.apply.__code__
"""The frame through which autograd runs every Python ``Function``'s backward, checkpointing's included."""


def in_nested_backward() -> bool:
    """Whether the caller runs inside a backward started from an autograd ``Function``'s backward (a reentrant
    checkpoint's recomputation): some frame below is that ``Function``'s backward. The engine calls the
    post-accumulate-grad hooks of the outermost backward with no such frame under them."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False


class GradientArrivals:
    """Per-parameter hook calls of the current backward, and per bucket how many parameters are not yet final
    (Note [final gradients]). Positions number the parameters bucket by bucket, in slot order."""

    def __init__(self, buckets: Sequence[FlatBucket]) -> None:
        self._start = [0] * len(buckets)
        """The position of each bucket's first parameter."""
        total = 0
        for i, bucket in enumerate(buckets):
            self._start[i] = total
            total += len(bucket.params)
        self._sizes = [len(b.params) for b in buckets]
        self.positions = total
        """How many parameters (positions) there are."""
        self.expected = [1] * total
        """Hook calls per backward after which a parameter's gradient is final; learned in the first backward."""
        self.learning = True
        """Until the first reducing backward has ended and ``learn`` has set ``expected``."""
        self._calls = [0] * total
        self._unfinished = list(self._sizes)
        self._held: set[int] = set()
        """Buckets the learning backward holds to its flush: a gradient arrived in a nested backward."""
        self.last_call = [-1] * len(buckets)
        """The tick of each bucket's latest hook call in the learning backward: its place in the observed order."""
        self._clock = 0

    def position(self, bucket_index: int, slot_index: int) -> int:
        return self._start[bucket_index] + slot_index

    def arrive(self, bucket_index: int, position: int) -> bool:
        """Count a hook call; True when it makes the bucket's last parameter final."""
        calls = self._calls[position] = self._calls[position] + 1
        if self.learning:
            self.last_call[bucket_index] = self._clock
            self._clock += 1
            if bucket_index not in self._held and in_nested_backward():
                self._held.add(bucket_index)
        if calls != self.expected[position]:
            return False
        self._unfinished[bucket_index] -= 1
        return self._unfinished[bucket_index] == 0

    def declare_final(self, bucket_index: int) -> None:
        """The caller knows the bucket is complete (stage 3's data-dependent units)."""
        self._unfinished[bucket_index] = 0
        if self.learning:
            self.last_call[bucket_index] = self._clock
            self._clock += 1

    def held(self, bucket_index: int) -> bool:
        """Whether the learning backward holds the bucket to its flush: its gradients may not be final yet."""
        return bucket_index in self._held

    def launchable(self, bucket_index: int) -> bool:
        """Whether the hooks may launch the bucket now: all its parameters final, and not held."""
        return self._unfinished[bucket_index] == 0 and bucket_index not in self._held

    def calls(self) -> torch.Tensor:
        """(parameters,) this backward's hook calls per parameter, for ``learn`` after a max over ranks."""
        return torch.tensor(self._calls, dtype=torch.int64)

    def learn(self, max_calls: list[int]) -> None:
        """Set ``expected`` from the learning backward's calls, maxed over ranks (Note [final gradients])."""
        self.expected = [max(1, c) for c in max_calls]
        self.learning = False
        self._held.clear()

    def reset(self) -> None:
        """A new backward: nothing has arrived."""
        self._calls = [0] * len(self._calls)
        self._unfinished = list(self._sizes)


def late_gradient_error(slot: ParamSlot) -> RuntimeError:
    """Note [final gradients]: the case no rank can repair alone."""
    return RuntimeError(
        f"Parameter {slot.fqn!r} received a gradient after its bucket was reduced in this backward: it was used in "
        "more reentrant activation-checkpoint segments, or outside them and then in one, than the first backward "
        "showed, and a late contribution cannot be reduced without every rank reducing the bucket again. HINT: "
        "checkpoint with `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` "
        "(Hugging Face: `gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})`), "
        "which hands every parameter its whole gradient at once."
    )
