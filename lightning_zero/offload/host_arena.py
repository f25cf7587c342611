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

Note [huge pages]
An Adam step streams four arrays (masters, gradients, both moments) through the cores once, and on 4 KiB pages
every 1024 floats of each stream cost a TLB miss and a page walk. Backed by 2 MiB pages the same fused kernel took
0.83x the time (torch's ``_fused_adamw_``, 24 x 4M fp32 elements, one thread, 2026-11-28; 0.86x with the pages
collapsed after they were written). Linux backs an anonymous mapping with huge pages on first touch only where
``madvise(MADV_HUGEPAGE)`` allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most
distributions, and torch's allocator advises nothing unless ``THP_MEM_ALLOC_ENABLE=1`` is set before it starts).
So the host buffers the step streams are advised before anything writes them: the arena's slabs (before
``cudaHostRegister`` pins them, which touches every page: the host tier's masters and gradients) and
``HostAdam``'s flat moments. Masters already written (on a CPU device the host tier steps the parameter shard in
place) are collapsed into huge pages at their bucket's first step (``MADV_COLLAPSE``, Linux 6.1+: a copy of the
data, once). A CPU device's gradient shards, which the reducer frees between steps (Note [gradient shards between
steps]), are advised as it allocates them (``ShardedGradReducer.advise_shard``): with them on 4 KiB pages the other
three streams' huge pages gained nothing measurable (1.00x torch's fused step on 4 KiB pages, 50M parameters, one
thread, load average 10), with them 0.90-0.95x. Only whole 2 MiB pages inside a buffer are advised: no byte more is
used. The advice is a hint: an older kernel, THP set to ``never``, fragmented memory or another platform leave the
pages as they are, with the same results.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import Tensor

_ALIGN = 64
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def huge_pages(tensor: Tensor, collapse: bool = False) -> bool:
    """Back the whole 2 MiB pages of ``tensor``'s host memory with huge pages (Note [huge pages]): advised, for
    memory not yet written, or ``collapse``d now, for memory already written. Whether the kernel took the advice."""
    if _LIBC is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return False
    advice = _MADV_COLLAPSE if collapse else _MADV_HUGEPAGE
    return int(_LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(advice))) == 0


def zeros_on_huge_pages(numel: int, dtype: torch.dtype) -> Tensor:
    """A ``(numel,)`` host tensor of zeros, its whole 2 MiB pages advised before they are written (Note [huge
    pages])."""
    tensor = torch.empty(numel, dtype=dtype)
    huge_pages(tensor)
    return tensor.zero_()


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
        huge_pages(slab)  # before anything touches it: Note [huge pages]
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
