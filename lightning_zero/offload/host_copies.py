"""The host tier's copies between device memory and (pinned) host memory: ``CopyStream`` and ``HostStore``.

Note [host tier data path]
ZeRO-Offload (``offload_optimizer="cpu"``) keeps the fp32 masters and the optimizer state in host memory and runs
the optimizer step there; ``offload_params="cpu"`` (stage 3) keeps the parameter shards there between uses. When
the device is not the host (CUDA), this is the data path (``host_tier.py`` for the optimizer's side):

- **buffers**: each host-tier bucket gets a host fp32 master (for the segments this rank steps), a host gradient
  buffer and, for low-precision parameters, a host staging buffer of the parameter dtype, all pinned (page-locked)
  so that copies run asynchronously; the optimizer creates its state on the host masters, on the host;
- **gradients down**: when a bucket's reduce-scatter completes in the last backward before the step
  (``GradientReducer.on_reduced``), its gradient shard is copied device-to-host on a side stream (``CopyStream``)
  that first waits for the compute stream, so the copy overlaps the rest of backward. The step waits for that copy's
  event on the host before it reads the gradients; a device shard is kept referenced until then;
- **the step** runs bucket by bucket on the host masters, with torch's fused CPU kernels (Adam, AdamW, SGD,
  Adagrad) or else the multi-tensor ones, unless the optimizer asks otherwise (Note [tier step kernels]); for
  Adam and AdamW on a worker thread, with the gradient's conversion, unscaling and clipping before it and the
  rounding after it (Note [host step threads]); clipping takes its norm on the device shards the host copies
  are taken from, and applies the coefficient as the step reads the gradients;
- **parameters up**: after a bucket is stepped its masters are rounded into the staging buffer and copied
  host-to-device into the parameter shard on the side stream; the compute stream waits for that event (not the
  host), so the all-gather that follows (stages 1 and 2), or stage 3's next gather, reads the updated shard;
- **edits**: the host master is separate memory even for fp32 parameters, so a parameter shard written since the
  step wrote it (found on the device by its digest, Note [edits reach the masters]) is copied device-to-host before
  its bucket's step and its edited elements adopted; a steady step copies no parameter to the host;
- **stage-3 parameter shards** (``offload_params="cpu"``) live in a ``HostStore``, the host tier's store for the
  ``TensorSwapper``: a unit's shard gets device memory only while it is used, is copied host-to-device ahead of the
  unit's gather in the order the previous step used them (Note [read-ahead order]) without the host waiting for
  the copy (Note [stream-ordered reads] in ``tensor_swapper.py``), and copied back only if it was modified (a
  write-back gather); the step writes the new values into the store.

On a CPU device (these machines) the device is the host and none of this moves anything: the host tier is the
normal step (copies between tensors of the same device are skipped). ``FORCE_COPIES`` (tests only) makes a CPU
run take the path above anyway, with separate host buffers and explicit copies, so that its logic (when a
gradient is copied, what the step reads, what is written back and when) is checked against DDP on CPU; the
streams and events themselves are inert on the CPU and have not run on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

FORCE_COPIES = False
"""Tests only: take the host tier's copy path on a CPU device too (Note [host tier data path])."""


def uses_copies(device: torch.device) -> bool:
    """Whether the host tier copies between the device and separate host buffers (Note [host tier data path])."""
    return device.type != "cpu" or FORCE_COPIES


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized host tensor, pinned when ``device`` is an accelerator (asynchronous copies need that)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


class Copy:
    """A copy issued on a ``CopyStream``: ``wait()`` blocks the host until it is done (and lets its tensors go);
    ``order_compute()`` makes the calling thread's current (compute) stream wait for it without blocking the host."""

    def __init__(self, event: Any | None, keep: tuple[Tensor, ...], device: torch.device) -> None:
        self._event = event
        self._keep = keep  # the source and target must outlive the copy
        self._device = device

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        self._keep = ()

    def order_compute(self) -> None:
        if self._event is not None:
            torch.get_device_module(self._device).current_stream(self._device).wait_event(self._event)


class CopyStream:
    """A side stream of ``device`` for host-device copies, ordered against compute by events as the collective
    streams are (Note [collective streams]); inert on the CPU, where a copy is done when ``copy`` returns."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module: Any | None = None if device.type in ("cpu", "meta") else torch.get_device_module(device)
        self.stream: Any | None = None if self._module is None else self._module.Stream(device=device)

    def copy(self, dst: Tensor, src: Tensor) -> Copy:
        """``dst.copy_(src)`` after everything the compute stream queued so far."""
        if self.stream is None or self._module is None:
            dst.copy_(src)
            return Copy(None, (), self.device)
        self.stream.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = self.stream.record_event()
        return Copy(event, (dst, src), self.device)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far is done."""
        if self.stream is not None:
            self.stream.synchronize()


class HostStore:
    """The host tier's ``TierStore`` for a ``TensorSwapper`` of device tensors: one host buffer per key, filled and
    drained by copies on a ``CopyStream`` (Note [host tier data path]). A move is issued on the calling thread (so
    it is ordered after the compute that produced its tensor) and waited for on the swapper's background thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = CopyStream(device)
        self._host: dict[Hashable, Tensor] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        """Bytes copied to the device (a shard made resident); ranged access by checkpoints and the host step,
        which stays in host memory, is not counted."""
        self.bytes_written = 0
        """Bytes copied from the device (a modified shard written back)."""

    @property
    def nbytes(self) -> int:
        """Host bytes the store holds."""
        return sum(t.numel() for t in self._host.values())

    def _buffer(self, key: Hashable, nbytes: int) -> Tensor:
        """``key``'s host bytes, allocated on first use."""
        host = self._host.get(key)
        if host is None or host.numel() < nbytes:
            host = self._host[key] = host_empty(nbytes, torch.uint8, self.device)
        return host

    def _view(self, key: Hashable, like: Tensor, start: int = 0) -> Tensor:
        nbytes = like.numel() * like.element_size()
        return self._buffer(key, start + nbytes)[start : start + nbytes].view(like.dtype)

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written

    def start_write(self, key: Hashable, tensor: Tensor) -> Callable[[], None]:
        copy = self.copies.copy(self._view(key, tensor).view(tensor.shape), tensor)
        self._count(written=tensor.numel() * tensor.element_size())
        return copy.wait

    def start_read(self, key: Hashable, tensor: Tensor) -> Copy:
        """The copy to the device, ordered by stream events where it is used (Note [stream-ordered reads])."""
        assert key in self._host, f"{key} was never written to the host tier"
        copy = self.copies.copy(tensor, self._view(key, tensor).view(tensor.shape))
        self._count(read=tensor.numel() * tensor.element_size())
        return copy

    def read_range(self, key: Hashable, start: int, out: Tensor) -> None:
        out.copy_(self._view(key, out, start))  # host memory to host memory: not counted

    def write_range(self, key: Hashable, nbytes: int, start: int, values: Tensor) -> None:
        self._buffer(key, nbytes)
        self._view(key, values, start).copy_(values)

    def close(self) -> None:
        self.copies.synchronize()  # no copy still reads or writes the buffers
        self._host.clear()
