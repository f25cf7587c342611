"""``PendingCollective``: an issued collective, the buffers it holds until it completes, and what it sent.

Every collective of ``collectives.py`` (and ZeRO++'s, ``quantized_all_gather.py``, ``hierarchical_reduce.py``)
returns one. ``wait()`` makes the result usable by the calling stream (Note [collective streams] in ``streams.py``)
and only then drops the buffers. Each call into ``torch.distributed`` it made is a ``Send``, measured at the call
(what was handed to it, and the bytes that leave this rank), which ``CommLedger`` (``ledger.py``) records per step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.streams import CollectiveStream


class Collective(str, Enum):
    """The collectives ZeRO issues, as recorded in the ledger."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"


@dataclass(frozen=True, slots=True)
class Send:
    """One call into ``torch.distributed``, measured at the call: the tensor this rank handed it to send."""

    op: str
    """The ``torch.distributed`` function called (``reduce_scatter_single``, ``broadcast``, ...)."""
    numel: int
    dtype: torch.dtype
    wire_bytes: int
    """Bytes of that tensor that leave this rank with the op's bandwidth-optimal algorithm: a reduce-scatter or an
    all-to-all sends the (N-1)/N of its input that other ranks own, an all-gather its input to N-1 ranks, the root
    of a broadcast its tensor to N-1 ranks (the others none), an all-reduce twice the (N-1)/N of its tensor."""
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """A collective's: ``wire_bytes`` go to every other rank of this group, in equal parts (Note [bytes by link] in
    ``ledger.py``, which splits them once per group, not per call). Not pickled: a group lives in its process."""
    peer: int | None = None
    """A point-to-point send's: the global rank ``wire_bytes`` go to."""

    def __reduce__(self) -> tuple[Any, ...]:
        return Send, (self.op, self.numel, self.dtype, self.wire_bytes, None, self.peer)


@dataclass
class PendingCollective:
    """An issued collective. ``wait()`` makes its result usable by the code (and stream) that calls it."""

    kind: Collective
    works: tuple[dist.Work, ...]
    """The asynchronous operations it was issued as (none for a world of one, several for a broadcast gather)."""
    buffers: tuple[Tensor, ...]
    """Tensors the collective reads or writes; held so they outlive the asynchronous work."""
    sends: tuple[Send, ...] = ()
    """Every call into ``torch.distributed`` it made, with what was handed to it."""
    finish: Callable[[], None] | None = None
    """Local work to run once the data has arrived (the sum of the all-to-all reduce-scatter, the average)."""
    stream: CollectiveStream | None = field(default=None, repr=False)
    """The side stream it was issued on and completes on (Note [collective streams]); None: the current stream."""

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank puts on the wire, from what each call was handed (see ``Send.wire_bytes``)."""
        return sum(send.wire_bytes for send in self.sends)

    def wait(self) -> None:
        with self.stream.complete() if self.stream is not None else nullcontext():
            for work in self.works:
                work.wait()
            self.works = ()
            if self.finish is not None:
                self.finish()
                self.finish = None
        # Only now may the buffers be reused or freed: the caller's stream is ordered after the collective.
        self.buffers = ()


def nbytes(tensor: Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def make_send(function: Callable[..., Any], tensor: Tensor, wire_bytes: int, group: dist.ProcessGroup) -> Send:
    """The ``Send`` of one call of ``function`` handed ``tensor``, sending ``wire_bytes`` to the rest of ``group``.
    O(1) in the group's size: where the bytes go is resolved by the ledger, once per group."""
    return Send(function.__name__, tensor.numel(), tensor.dtype, wire_bytes, group if wire_bytes else None)
