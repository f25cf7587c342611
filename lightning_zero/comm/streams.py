"""``CollectiveStream``: the device stream a kind of collective runs on, ordered against compute by events.

Note [collective streams]
On an accelerator (CUDA with NCCL), kernels run asynchronously on streams, and a collective is one more kernel. We
follow FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``, ``_fsdp_collectives.py``): all-gathers
and reduce-scatters each get a side stream of high priority, shared by every bucket or unit of that kind, and every
hand-off between a side stream and the compute stream is an event, never a host synchronization:

- **launch**: the side stream first waits for everything queued so far on the compute stream (the gradients a
  reduce-scatter sends, the freshly allocated target a gather writes, the updated shard it reads), then the
  collective is issued from the side stream (``async_op=True``; NCCL's own stream waits on the side stream).
  Everything compute queues afterwards (the rest of backward, the forward of the unit before a prefetched one)
  runs concurrently with it: that is the overlap.
- **complete**: on the side stream, ``work.wait()`` (a stream dependency, not a host wait, on NCCL) and the local
  post-processing (the average, the accumulation into the gradient shard) run; an event recorded after them is what
  the compute stream then waits on. Nothing the compute stream queued before ``complete`` waits.
- **lifetime**: every tensor a collective touches is allocated on the compute stream (pooled buffers, gather
  targets, shards) and referenced by its ``PendingCollective`` until ``complete`` has made the compute stream wait.
  Only then are buffers given back to the pool, storages resized to zero or references dropped, so the caching
  allocator, which reuses a block in the order of the stream it was allocated on, can never hand memory the side
  stream still reads or writes to a new compute kernel, and no ``record_stream`` is needed. Since we gather into
  the parameters' own storage (no copy-out, unlike FSDP2) there is no separate all-gather output to keep alive.

On a device without streams (the CPU, gloo) both context managers do nothing and the same code runs: the
collective's ``wait()`` blocks the calling thread, which is the ordering the CPU needs.

Note [one order of collectives]
An NCCL kernel holds its GPU until the matching kernels of its peers have joined it. Kernels of one communicator run
in the order they were issued (torch gives each communicator one internal stream); kernels of two communicators may
run side by side, or may not (too few free SMs, an allocation or anything else that synchronizes the device). So if
rank 0 issues X on communicator 1 and then Y on communicator 2 while rank 1 issues Y and then X, rank 0's X can wait
for rank 1's X, queued behind rank 1's Y, which waits for rank 0's Y, queued behind rank 0's X: a deadlock. NCCL's
user guide (Using multiple NCCL communicators concurrently) therefore asks that operations on different
communicators be issued in the same order on every rank, or never be in flight together. On one communicator the
order must agree anyway, or an all-gather pairs with a reduce-scatter. Stage 3 issues all-gathers (on the ZeRO group;
on a group of their own once data-dependent units exist, Note [data-dependent units] in ``stage3/divergence.py``;
on hpZ's node group in backward, Note [secondary shards]) and reduce-scatters (on the ZeRO group; qgZ's node and
cross-node groups) while a backward runs, so every rank must issue the two in one interleaving.

Reductions used to leave from the gradient hooks, as soon as a bucket's gradients were final. How far a rank got
depended on its data: in a mixture of experts gathered as one unit (Note [leaf modules]), a rank whose tokens skipped
an expert never got its gradients, so its block's bucket, and every bucket after it in bucket order, waited for the
end-of-backward flush, while a rank that used every expert reduced it before its next prefetch. With three such
blocks, rank 0 issued the second block's reduce-scatter before the first block's all-gather and rank 1 after it: on
the native (NCCL) path on gloo the two collectives paired and failed ("collective mismatch"); on NCCL, a hang. Even
when every rank gets every gradient, the order autograd runs a unit's nodes in depends on a graph the routing shapes.

So in stage 3 every collective of a backward is issued at a *unit event*, and what each event issues is decided by
state every rank shares. The events, a unit's pre-backward (gather it, prefetch the next), its post-backward (free
it, reduce it) and the end of the backward (the last rounds, the flush), come in the same sequence on every rank: it
is the sequence of units every rank runs, which the gathers already require (Note [divergence check]). The gradient
hooks only count (``GradientReducer.launch_by_caller``); a bucket is launched, in bucket order, once it is declared
complete, and the stage-3 gatherer declares a unit's buckets at its post-backward: when the last of the unit's
PostBackward hooks registered in forward has run (counts that are the same on every rank), or, in a reentrant
recomputation's backward, once the recomputation's own hooks have run, if the first backward showed (maxed over
ranks, Note [final gradients]) that each of its parameters gets its gradient in one segment. Everything else (a unit
none of whose inputs requires grad, the root, resident parameters, a parameter shared across segments, the first
backward under reentrant checkpointing) is launched by the flush. The prefetch limit counts a unit freed early by its
gradients' arrival as live until the backward ends, so that no prefetch depends on arrival times either. As in FSDP2,
a bucket leaves at its unit's post-backward rather than at its last gradient; the next unit's gather is in flight
by then. A forward issues only gathers, and the step's all-reduces come after the flush has waited for every
reduction. ``tests/test_collective_order.py`` records every rank's sequence of native collectives, with their
groups, for ranks that route differently, and requires them equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_HIGH_PRIORITY = -1
"""As FSDP2: collectives' copies and post-processing should not queue behind compute kernels."""


def _stream_module(device: torch.device) -> Any | None:
    """``torch.cuda`` (or the module of another accelerator) for a device with streams, None for the CPU."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device)


class CollectiveStream:
    """One side stream of ``device`` for one kind of collective (Note [collective streams]); inert on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = _stream_module(device)
        self.stream: Any | None = None
        """The device stream, or None where there are none."""
        if self._module is not None:
            self.stream = self._module.Stream(device=device, priority=_HIGH_PRIORITY)

    @contextmanager
    def launch(self) -> Iterator[None]:
        """Issue the block's collectives on the side stream, after everything compute queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(self._module.current_stream(self.device))  # type: ignore[union-attr]
        with self._module.stream(self.stream):  # type: ignore[union-attr]
            yield

    @contextmanager
    def complete(self) -> Iterator[None]:
        """Wait for a collective and post-process its result on the side stream; on exit compute waits for both."""
        if self.stream is None:
            yield
            return
        compute = self._module.current_stream(self.device)  # type: ignore[union-attr]
        with self._module.stream(self.stream):  # type: ignore[union-attr]
            yield
            done = self.stream.record_event()
        compute.wait_event(done)

    def __repr__(self) -> str:
        return f"CollectiveStream({self.device}, {'no streams' if self.stream is None else self.stream})"
