"""``MemoryTiers``: one rank's tiers, built from ``ZeroConfig``: where each shard lives and the objects that move it.

It owns the rank's tier directory and file (``directory``, ``swap_file``), the ``TensorSwapper`` over them (or over
the host tier's ``HostStore`` for stage-3 parameter shards in host memory, Note [host tier data path]), the stage-3
parameter tier (it is each unit's ``ShardSource`` and shards units straight into it, ``UnitTiers``), the stage-3
gradient reducer with shards on disk, and one ``OptimizerTiers`` per optimizer. Placement by ``offload_ratio``
(ZeRO-Offload++) takes buckets in gradient order until the offloaded elements reach the ratio.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_zero.config import ZeroConfig
from lightning_zero.offload.directory import OffloadDirectory
from lightning_zero.offload.host_copies import HostStore, uses_copies
from lightning_zero.offload.host_moments import DiskMoments
from lightning_zero.offload.host_steps import HostSteps
from lightning_zero.offload.host_tier import HostTier
from lightning_zero.offload.optimizer_tiers import OptimizerTiers, param_key
from lightning_zero.offload.swap_file import SwapFile
from lightning_zero.offload.tensor_swapper import TensorSwapper
from lightning_zero.offload.tiered_grad_reducer import TieredGradReducer
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer
from lightning_zero.stage3.sharded_unit import ShardedUnit


class TierBytes(NamedTuple):
    """This rank's model-state bytes by where they are right now."""

    device: int
    host: int
    disk: int


def place_by_ratio(buckets: Sequence[FlatBucket], ratio: float) -> set[int]:
    """ids of the first buckets (in the given order) whose shards make up ``ratio`` of all shard elements."""
    total = sum(b.shard_numel for b in buckets)
    chosen: set[int] = set()
    taken = 0
    for bucket in buckets:
        if taken >= ratio * total:
            break
        chosen.add(id(bucket))
        taken += bucket.shard_numel
    return chosen


class MemoryTiers:
    """The memory tiers of one rank (``config.offload_*``) on ``device``; ``directory`` is this rank's private
    directory when a tier is ``"disk"``; ``io_entries``: the read-ahead and write-behind budgets, in largest tier
    entries. The host tier copies between the device and host buffers where the device is not the host (Note [host
    tier data path]; the disk tier reads and writes host memory, so the two do not mix there)."""

    def __init__(
        self,
        config: ZeroConfig,
        directory: OffloadDirectory | None,
        io_entries: int,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.directory = directory
        self.device = device = device or torch.device("cpu")
        copies = uses_copies(device) and "disk" not in (config.offload_optimizer, config.offload_params)
        self.host_optimizer = copies and config.offload_optimizer == "cpu"
        """Whether the optimizer's placed buckets take the host tier's data path (``HostTier``)."""
        self.host_params = copies and config.offload_params == "cpu"
        if config.offload_overlap == "delayed" and not self.host_optimizer:
            raise ValueError(
                f"Invalid ZeroConfig: offload_overlap='delayed' on a {device.type} device. The delayed update overlaps "
                "the host's step with the accelerator's forward and backward; where the device is the host there "
                "is nothing to overlap. HINT: use offload_overlap='exact' (the default)."
            )
        """Whether stage-3 parameter shards live in host memory between uses (a ``HostStore``)."""
        self.swapper: TensorSwapper | None = None
        if directory is not None and "disk" in (config.offload_optimizer, config.offload_params):
            self.swapper = TensorSwapper(SwapFile(directory.file("tiers.bin")), io_entries)
        elif self.host_params:
            self.swapper = TensorSwapper(HostStore(device), io_entries)
        self.moment_swapper: TensorSwapper | None = None
        """The host step's moments on disk (Note [moments on disk] in ``host_moments.py``)."""
        if config.offload_optimizer_state == "disk":
            assert directory is not None, "offload_optimizer_state='disk' needs offload_dir (ZeroConfig checks it)"
            self.moment_swapper = TensorSwapper(SwapFile(directory.file("moments.bin")), io_entries)
        self.optimizer_tiers: list[OptimizerTiers] = []
        self.host_steps: list[HostSteps] = []
        self._placed: set[int] | None = None
        """Stage 3: ids of the buckets whose optimizer state (and, on disk, gradients) is in the optimizer's tier,
        decided with the reducer."""
        self._units: list[ShardedUnit] = []

    @property
    def params_on_disk(self) -> bool:
        """Whether stage-3 parameter shards live in the swapper (on disk, or in the host store)."""
        return self.swapper is not None and (self.config.offload_params == "disk" or self.host_params)

    @property
    def optimizer_on_disk(self) -> bool:
        return self.config.offload_optimizer == "disk" and self.swapper is not None

    # -- stage 3: UnitTiers and ShardSource ---------------------------------------------------------------------------
    def attach(self, unit: ShardedUnit) -> None:
        """A freshly sharded unit: its shards go to the parameter tier now (the unit's full parameters are already
        freed), so a model larger than memory is never in memory."""
        if not self.params_on_disk or not unit.buckets:
            return
        assert self.swapper is not None
        for bucket in unit.buckets:
            self.swapper.add(param_key(bucket), bucket.param_shard)
        self.swapper.evict_all()
        unit.shard_source = self
        self._units.append(unit)

    def acquire(self, bucket: FlatBucket) -> Tensor:
        assert self.swapper is not None
        return self.swapper.acquire(param_key(bucket))

    def release(self, bucket: FlatBucket) -> None:
        assert self.swapper is not None
        self.swapper.release(param_key(bucket))

    def reducer_factory(
        self, buckets: Sequence[FlatBucket], *reducer_args: Any, **reducer_kwargs: Any
    ) -> ShardedGradReducer:
        """Stage 3's gradient reducer over ``buckets`` (the rest: ``GradientReducer``'s arguments): with the optimizer
        on disk, the shards of the placed buckets go there too."""
        # Each stage-3 model placed by the ratio among its own buckets (a Fabric strategy sets up several models).
        placed = place_by_ratio(buckets, self.config.offload_ratio)
        self._placed = placed | (self._placed or set())
        if not self.optimizer_on_disk:
            return ShardedGradReducer(buckets, *reducer_args, **reducer_kwargs)
        assert self.swapper is not None
        return TieredGradReducer(
            buckets, *reducer_args, swapper=self.swapper, on_disk=lambda b: id(b) in placed, **reducer_kwargs
        )

    # -- optimizers ----------------------------------------------------------------------------------------------------
    def for_optimizer(self) -> OptimizerTiers:
        """The ``StateTiers`` of one more optimizer; its buckets are placed when it builds its masters."""
        swapper = self.swapper if self.optimizer_on_disk or self.params_on_disk else None
        host = HostTier(self.device, self.swapper if self.host_params else None) if self.host_optimizer else None
        host_steps = None
        if self.config.offload_optimizer == "cpu":
            delayed = self.config.offload_overlap == "delayed"
            host_steps = HostSteps(self.config.offload_overlap_warmup if delayed else None)
            self.host_steps.append(host_steps)
        moments = DiskMoments(self.moment_swapper) if self.moment_swapper is not None else None
        tiers = OptimizerTiers(swapper, self._place, host, self.config.offload_optimizer != "none", host_steps, moments)
        self.optimizer_tiers.append(tiers)
        return tiers

    def set_step_number(self, step: int) -> None:
        """The ``Trainer``'s ``global_step`` of the step about to run (Note [delayed parameter update])."""
        for host_steps in self.host_steps:
            host_steps.step_number = step

    def _place(self, buckets: list[FlatBucket]) -> set[int]:
        if not (self.optimizer_on_disk or self.host_optimizer):
            return set()
        if self._placed is not None:  # stage 3: as the gradient reducer placed them
            return {id(b) for b in buckets if id(b) in self._placed}
        return place_by_ratio(buckets, self.config.offload_ratio)

    # -- checkpoints: TierStorage (Note [checkpoints stream through the tiers] in checkpoint/tiered.py) -----------
    def holds(self, tensor: Tensor) -> bool:
        return any(s.owner(tensor) is not None for s in self._swappers())

    def read(self, tensor: Tensor, start: int, numel: int) -> Tensor:
        swapper, key = self._owner(tensor)
        out = torch.empty(numel, dtype=tensor.dtype)  # host memory: what a checkpoint writes
        swapper.read_range(key, int(tensor.storage_offset() + start) * tensor.element_size(), out)
        return out

    def write(self, tensor: Tensor, start: int, values: Tensor) -> None:
        swapper, key = self._owner(tensor)
        swapper.write_range(key, int(tensor.storage_offset() + start) * tensor.element_size(), values.to(tensor.dtype))

    def _owner(self, tensor: Tensor) -> tuple[TensorSwapper, Hashable]:
        for swapper in self._swappers():
            key = swapper.owner(tensor)
            if key is not None:
                return swapper, key
        raise AssertionError("not a tensor of the memory tiers")

    def _swappers(self) -> list[TensorSwapper]:
        return [s for s in (self.swapper, self.moment_swapper) if s is not None]

    # -- whole-state access (whole-model swaps) and accounting -------------------------------------------------------
    def load_all(self) -> None:
        """Every shard of this rank resident, for a swap of the whole model (not bounded by the tiers' memory)."""
        for unit in self._units:
            for bucket in unit.buckets:
                self.acquire(bucket)
        for tiers in self.optimizer_tiers:
            tiers.load_all()

    def unload_all(self) -> None:
        for tiers in self.optimizer_tiers:
            tiers.unload_all()
        for unit in self._units:
            for bucket in unit.buckets:
                self.release(bucket)
        for swapper in self._swappers():
            swapper.evict_all()
            swapper.flush()

    def host_copy_bytes(self) -> tuple[int, int]:
        """(to the host, to the device): bytes the host tier has copied so far (Note [host tier data path])."""
        hosts = [t.host for t in self.optimizer_tiers if t.host is not None]
        down = sum(h.bytes_to_host for h in hosts)
        up = sum(h.bytes_to_device for h in hosts)
        if self.swapper is not None and self.host_params:
            down, up = down + self.swapper.file.bytes_written, up + self.swapper.file.bytes_read
        return down, up

    def host_store_bytes(self) -> int:
        """Bytes of stage-3 parameter shards kept in host memory by the host store (with copies to the device)."""
        return self.swapper.disk_nbytes() if self.swapper is not None and self.host_params else 0

    def disk_bytes(self) -> int:
        return sum(s.disk_nbytes() for s in self._files())

    def io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of the tier files so far."""
        files = self._files()
        return sum(s.file.bytes_read for s in files), sum(s.file.bytes_written for s in files)

    def _files(self) -> list[TensorSwapper]:
        """The swappers over files on disk (not the host store)."""
        return [s for s in self._swappers() if isinstance(s.file, SwapFile)]

    def restore(self) -> None:
        """At the end of a job that went well: the parameter shards come back into memory (the model outlives the
        tier files, as it does without tiers); the optimizer state of tiered buckets is discarded with the files."""
        if self.moment_swapper is not None:
            self.moment_swapper.flush()
        if self.swapper is None:
            for tiers in self.optimizer_tiers:
                tiers.discard()
            return
        self.swapper.flush()
        for unit in self._units:
            for bucket in unit.buckets:
                self.swapper.acquire(param_key(bucket))  # kept: the files are about to go
            unit.shard_source = None
        self._units = []
        for tiers in self.optimizer_tiers:
            tiers.discard()

    def close(self, remove: bool = True) -> None:
        """Stop the IO threads and (``remove``) delete this rank's tier directory."""
        for host_steps in self.host_steps:
            host_steps.close()
        for tiers in self.optimizer_tiers:
            if tiers.host is not None:
                tiers.host.close()
        for swapper in self._swappers():
            swapper.close()
        if remove and self.directory is not None:
            self.directory.remove()

    @property
    def path(self) -> Path | None:
        return self.directory.path if self.directory is not None else None

    def describe(self) -> dict[str, Any]:
        return {
            "offload_optimizer": self.config.offload_optimizer,
            "offload_optimizer_state": self.config.offload_optimizer_state,
            "offload_params": self.config.offload_params,
        }
