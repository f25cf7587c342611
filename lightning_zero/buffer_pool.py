"""``BufferPool``: reusable flat scratch buffers for the gradient reduction.

Every backward needs, per bucket, a full-size buffer to collect gradients in (stages 2 and 3) and, on gloo, one to
receive the all-to-all in (Note [reduce-scatter on gloo]). Allocating them afresh each time costs a page fault per
4 KiB page on every backward (~5 ms per 16 MB buffer when the allocator returns large blocks to the kernel, as glibc
does above its mmap threshold and as any allocator does under memory pressure), and zeroing them costs a pass over
the memory. A pool hands out buffers it already owns, with arbitrary content, so they are paid for once.

The pool keeps as many buffers as were ever lent at the same time (a few: ``max_inflight_buckets`` in flight plus
the buckets filling), each as large as the largest size reserved or requested for its dtype and device, until
``clear()``. Buffers are not model state; ``nbytes()`` reports them.
"""

from __future__ import annotations

import torch
from torch import Tensor


class BufferPool:
    """Free lists of 1-D buffers per (dtype, device): ``take`` lends a view of ``numel`` elements, ``give`` takes it
    back."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        self._lent: dict[int, Tensor] = {}
        """data_ptr of a lent view -> the pooled buffer it is a view of."""
        self._owned: dict[tuple[torch.dtype, torch.device], int] = {}
        """Bytes of every buffer of the pool, lent or free."""
        self._size: dict[tuple[torch.dtype, torch.device], int] = {}
        """Elements of each new buffer: the largest size ever reserved or requested."""

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Announce a request size, so that buffers are allocated large enough for it from the start (and are
        never allocated twice because a larger request came later)."""
        key = (dtype, device)
        self._size[key] = max(self._size.get(key, 0), numel)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D tensor of ``numel`` elements, uninitialized (it holds whatever its last user left)."""
        key = (dtype, device)
        free = self._free.setdefault(key, [])
        fits = [i for i, b in enumerate(free) if b.numel() >= numel]
        best = min(fits, key=lambda i: free[i].numel()) if fits else -1  # the smallest that fits
        buffer = free.pop(best) if free else None
        if buffer is None or buffer.numel() < numel:
            if buffer is not None:  # too small for this request: replace it by one that fits every request so far
                self._owned[key] -= buffer.numel() * buffer.element_size()
            self.reserve(numel, dtype, device)
            buffer = torch.empty(self._size[key], dtype=dtype, device=device)
            self._owned[key] = self._owned.get(key, 0) + buffer.numel() * buffer.element_size()
        view = buffer[:numel]
        assert view.data_ptr() not in self._lent, "a pooled buffer was lent twice"
        self._lent[view.data_ptr()] = buffer
        return view

    def give(self, view: Tensor) -> None:
        """Return a tensor obtained from ``take``; its memory may be handed out again by the next ``take``."""
        buffer = self._lent.pop(view.data_ptr())
        self._free.setdefault((buffer.dtype, buffer.device), []).append(buffer)

    def lent(self) -> int:
        return len(self._lent)

    def nbytes(self) -> int:
        """Bytes of every buffer the pool owns, lent or free."""
        return sum(self._owned.values())

    def clear(self) -> None:
        """Drop the free buffers, e.g. after training, so that their memory goes back to the allocator."""
        for key, free in self._free.items():
            self._owned[key] -= sum(b.numel() * b.element_size() for b in free)
            free.clear()
