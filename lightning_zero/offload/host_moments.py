"""``DiskMoments``: the host step's moments on the disk tier, beside masters that stay in host memory.

Note [moments on disk]
With ``offload_optimizer="cpu"`` a parameter costs 16 bytes of host memory in fp32: the master (4), Adam's two
moments (8) and the gradient (4). ``offload_optimizer_state="disk"`` moves the moments, half of that, to a file
under ``offload_dir`` (ZeRO-Infinity's optimizer-state tier), so that a box's host memory and disk add up: a model
whose masters and gradients fit in host memory trains although its moments do not.

The moments are ``HostAdam``'s flat per-bucket tensors (Note [bucketed host Adam]), each one entry of a
``TensorSwapper`` over the file ``moments.bin``: created at the bucket's first step (zeros, in memory, written
when the step is over), read ahead of each later step in the order the previous step used them (Note [read-ahead
order]) while the bucket before is stepped, held while the worker thread steps the bucket, and written behind once
its update has landed. torch's fused kernels do not move the moments' version counters (Note [tier step kernels]),
so a bucket's moments are marked modified when it is unloaded after a step. The optimizer state's entries are views
of the flat tensors as always, so ``optimizer.state`` and checkpoints keep torch's format: a checkpoint reads and
writes them by range in the file (Note [ranged tier access]), ``state_dict()`` loads them all. The masters stay
where the host tier keeps them; only what the host step reads and writes per bucket goes to disk, 8 bytes per
parameter read and written per step.

Only ``HostAdam`` steps through here: an optimizer or param group it does not cover is refused at setup. The
delayed update is refused too (it would hold every bucket's moments through the next forward and backward).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from lightning_zero.offload.tensor_swapper import TensorSwapper


def moments_key(bucket: int, name: str) -> tuple[str, int, str]:
    return ("moments", bucket, name)


class DiskMoments:
    """The flat moments of the buckets ``HostAdam`` steps, in ``swapper`` between uses (Note [moments on disk])."""

    def __init__(self, swapper: TensorSwapper) -> None:
        self.swapper = swapper
        self._keys: dict[int, list[Hashable]] = {}
        """Per bucket (``id``): its registered moment entries."""
        self._held: set[Hashable] = set()

    def allocate(self, bucket: int, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        """``HostAdam``'s allocator: a new flat moment (zeros, in memory), registered and held until ``unload``."""
        flat = torch.zeros(numel, dtype=dtype)
        key = moments_key(bucket, name)
        self.swapper.add(key, flat)
        self.swapper.acquire(key, read=False)
        self._keys.setdefault(bucket, []).append(key)
        self._held.add(key)
        return flat

    def __contains__(self, bucket: int) -> bool:
        return bucket in self._keys

    def load(self, bucket: int, in_order: bool) -> None:
        """The bucket's moments in memory (read, or already read ahead); ``in_order``: a use in the step's order."""
        for key in self._keys.get(bucket, []):
            if key not in self._held:
                self.swapper.acquire(key, in_order=in_order)
                self._held.add(key)

    def unload(self, bucket: int, stepped: bool) -> None:
        """Back to the file: written behind if ``stepped`` (the fused kernel does not mark them) or new."""
        keys = [k for k in self._keys.get(bucket, []) if k in self._held]
        if stepped and keys:
            increment_version([self.swapper.tensor(k) for k in keys])
        for key in keys:
            self._held.discard(key)
            self.swapper.release(key)

    def end_step(self) -> None:
        self.swapper.end_step()
