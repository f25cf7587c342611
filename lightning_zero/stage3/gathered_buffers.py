"""``GatheredBuffers``: the memory of a released unit's full buffers, handed to the next gather of the same size.

Note [gathered buffers reused]
Every gather of a unit needs memory for its full parameters and every release frees it (Note [freeing saved views]
in ``sharding/flat_bucket.py``): twice per step for each unit. On a GPU the caching allocator serves the next
gather from the block the last release gave back. On the CPU, under an allocator that returns large blocks to the
kernel (glibc above its mmap threshold, or any allocator under memory pressure), each gather maps new pages and
page-faults on every 4 KiB of them while the all-gather writes: about a millisecond per MiB, paid on the critical
path of the step. Here a release may instead keep the memory (``FlatBucket.release(keep_memory=True)`` moves it out
of the bucket's storage into a holder tensor, leaving the storage empty, which frees nothing and faults nothing) and
the next gather of a bucket of the same byte size takes it over (``FlatBucket.allocate_full(memory)``): the holder's
memory becomes that bucket's storage, so the views autograd saved of the receiving bucket see it as theirs.

What is kept is decided at each release by the gatherer: only memory that a gather of this pass will take within
the next few units of the order (``ParameterGatherer._reused_soon``), so the pool never holds more than the units
already gathered at once would; it is emptied at the end of every forward and backward, so nothing it holds sits on
top of the activations at the step's memory peak (the start of backward) or between steps. The same views that
keep ``allocate_full``'s contract keep this one: memory moves between storages of equal size, never shrinks or grows
under a view.

Only on the CPU: CUDA's caching allocator already recycles the blocks, with the stream ordering FSDP2 relies on, and
moving memory between storages would bypass that ordering. Without ``UntypedStorage._swap_data_ptr_`` (older torch)
nothing is kept and every gather allocates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.compat import SWAPS_STORAGE_MEMORY


class GatheredBuffers:
    """Free memory of released full buffers, by byte size (Note [gathered buffers reused])."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cpu" and SWAPS_STORAGE_MEMORY
        """Whether releases may keep memory here: on the CPU, with a torch that can move storage memory."""
        self._free: dict[int, list[Tensor]] = {}
        self._nbytes = 0
        self.reused = 0
        """How many gathers took kept memory instead of allocating, since the gatherer was built."""

    def take(self, nbytes: int) -> Tensor | None:
        """A holder of ``nbytes`` of memory for ``FlatBucket.allocate_full``, or None: allocate afresh."""
        free = self._free.get(nbytes)
        if not free:
            return None
        self._nbytes -= nbytes
        self.reused += 1
        return free.pop()

    def give(self, memory: Tensor) -> None:
        """Keep a holder returned by ``FlatBucket.release(keep_memory=True)``."""
        nbytes = memory.untyped_storage().nbytes()
        self._free.setdefault(nbytes, []).append(memory)
        self._nbytes += nbytes

    def clear(self) -> None:
        """Free everything kept (the end of a forward or a backward)."""
        self._free.clear()
        self._nbytes = 0

    def nbytes(self) -> int:
        """Bytes of memory kept and not lent."""
        return self._nbytes
