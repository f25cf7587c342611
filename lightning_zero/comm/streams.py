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
