"""``HostArena``: the host tier's pinned buffers, carved at their exact sizes out of a few registered slabs.

Note [pinned bytes]
torch's pinned-memory allocator (``CachingHostAllocator``, behind ``torch.empty(..., pin_memory=True)``) rounds
every allocation up to the next power of two, to reuse freed blocks. A host-tier buffer per bucket therefore cost
up to twice its size: the 4.10B-parameter GPT of the GPU check (width 2048, a 50.4M-parameter unit per block) held
each fp32 master of 201 MB and each bf16 gradient and staging buffer of 101 MB in 256 MiB and 128 MiB blocks, 33%
more, which is how 16 bytes of state per parameter became about 19 of host memory. The arena allocates what the
tier says it will need (``reserve``) as one ordinary host allocation of exactly that size, page-locks it once with
``cudaHostRegister`` (the same pinning, without the rounding), and places the buffers in it at their exact sizes,
64-byte aligned; a buffer beyond the reservation gets a slab of its own size. ``reserved_bytes`` counts the slabs.
On a CPU device nothing is pinned and the same accounting holds. The registration is undone when the tier closes.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ALIGN = 64


class HostArena:
    """Host tensors of exact sizes in a few slabs (Note [pinned bytes]), page-locked when ``device`` is CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slabs: list[Tensor] = []
        self._used: list[int] = []
        self._registered: list[Tensor] = []
        self._expected = 0
        self.used_bytes = 0
        """Bytes of the buffers handed out (with their alignment)."""

    def reserve(self, sizes: list[int]) -> None:
        """Buffers of these byte sizes are expected: the next slab is sized for them."""
        self._expected += sum(-(-n // _ALIGN) * _ALIGN for n in sizes)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slabs: what the host allocator gave out for the tier's buffers."""
        return sum(s.numel() for s in self._slabs)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """An uninitialized ``(numel,)`` tensor of ``dtype`` in the arena."""
        size = -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        for i, slab in enumerate(self._slabs):
            if self._used[i] + size <= slab.numel():
                return self._take(i, size, numel, dtype)
        remaining = self._expected - self.reserved_bytes
        self._slabs.append(self._pinned(max(size, remaining)))
        self._used.append(0)
        return self._take(len(self._slabs) - 1, size, numel, dtype)

    def _take(self, slab: int, size: int, numel: int, dtype: torch.dtype) -> Tensor:
        start = self._used[slab]
        self._used[slab] += size
        self.used_bytes += size
        return self._slabs[slab][start : start + size].view(dtype)[:numel]

    def _pinned(self, nbytes: int) -> Tensor:
        slab = torch.empty(nbytes, dtype=torch.uint8)
        if self.device.type == "cuda":
            error = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes of host memory failed with error {error}.")
            self._registered.append(slab)
        return slab

    def close(self) -> None:
        """Undo the page-locking (no copy may still use the buffers)."""
        for slab in self._registered:
            torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
        self._registered.clear()
