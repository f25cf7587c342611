"""``BufferPool``: reusable flat scratch buffers for the gradient reduction.

Every backward needs, per bucket, a full-size buffer to collect gradients in (stages 2 and 3) and, on gloo beyond
two ranks, one to receive the other ranks' chunks in (Note [reduce-scatter on gloo]). Allocating them afresh each
time costs a page fault per 4 KiB page on every backward (~5 ms per 16 MB buffer when the allocator returns large
blocks to the kernel, as glibc does above its mmap threshold and as any allocator does under memory pressure), and
zeroing them costs a pass over the memory. A pool hands out buffers it already owns, with arbitrary content, so
they are paid for once.

Note [size classes]
Buckets are of about one size, except a few holding one large parameter (an embedding can be twice a bucket). A
buffer sized for the largest bucket would make every buffer that large; one buffer per exact size would keep a
different buffer for each bucket. So sizes announced with ``reserve`` are grouped into classes, each covering sizes
within 25% of one another, and a request is served by a buffer of the smallest class that fits it. Each class
then holds as many buffers as were ever lent from it at the same time. Buffers are not model state; ``nbytes()``
reports them.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

_CLASS_SPREAD = 1.25
"""Sizes up to this factor apart share a class (and its buffers): Note [size classes]."""

_Key = tuple[torch.dtype, torch.device]


class BufferPool:
    """Free lists of 1-D buffers per dtype, device and size class: ``take`` lends a view of ``numel`` elements,
    ``give`` takes it back."""

    def __init__(self) -> None:
        self._sizes: dict[_Key, list[int]] = {}
        """Every size reserved or requested, sorted."""
        self._classes: dict[_Key, list[int]] = {}
        """Sorted buffer sizes, one per class: Note [size classes]."""
        self._free: dict[tuple[_Key, int], list[Tensor]] = {}
        self._lent: dict[int, Tensor] = {}
        """data_ptr of a lent view -> the pooled buffer it is a view of."""
        self._owned = 0
        """Bytes of every buffer of the pool, lent or free."""

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Announce a request size, so that it is served from the right class from the first request on."""
        key = (dtype, device)
        sizes = self._sizes.setdefault(key, [])
        if numel in sizes:
            return
        bisect.insort(sizes, numel)
        classes: list[int] = []
        start = 0
        for i, size in enumerate(sizes):
            if size > sizes[start] * _CLASS_SPREAD:
                classes.append(sizes[i - 1])
                start = i
        classes.append(sizes[-1])
        self._classes[key] = classes
        for (other, size), free in self._free.items():  # buffers of a class that no longer exists
            if other == key and size not in classes:
                self._owned -= sum(b.numel() * b.element_size() for b in free)
                free.clear()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D tensor of ``numel`` elements, uninitialized (it holds whatever its last user left)."""
        key = (dtype, device)
        if numel not in self._sizes.get(key, ()):  # a size not announced: give it its class (Note [size classes])
            self.reserve(numel, dtype, device)
        classes = self._classes[key]
        size = classes[bisect.bisect_left(classes, numel)]
        free = self._free.setdefault((key, size), [])
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._owned += buffer.numel() * buffer.element_size()
        view = buffer[:numel]
        assert view.data_ptr() not in self._lent, "a pooled buffer was lent twice"
        self._lent[view.data_ptr()] = buffer
        return view

    def give(self, view: Tensor) -> None:
        """Return a tensor obtained from ``take``; its memory may be handed out again by the next ``take``."""
        buffer = self._lent.pop(view.data_ptr())
        key = (buffer.dtype, buffer.device)
        if buffer.numel() not in self._classes[key]:  # its class was merged into a larger one meanwhile
            self._owned -= buffer.numel() * buffer.element_size()
            return
        self._free.setdefault((key, buffer.numel()), []).append(buffer)

    def lent(self) -> int:
        return len(self._lent)

    def nbytes(self) -> int:
        """Bytes of every buffer the pool owns, lent or free."""
        return self._owned

    def clear(self) -> None:
        """Drop the free buffers, so that their memory goes back to the allocator (lent ones stay lent)."""
        for free in self._free.values():
            self._owned -= sum(b.numel() * b.element_size() for b in free)
            free.clear()
