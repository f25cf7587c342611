"""``RankLayout``: what the engine reads of a front door's strategy about this rank's place among the others (its
process group, device, rank, world size and processes per node), under the names Lightning's strategies give them,
so that either door hands itself over; and ``world_group``, the process group both doors train on."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class RankLayout(Protocol):
    """This rank among the others: what ``ZeroStrategy`` and ``ZeroFabricStrategy`` both expose."""

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The data-parallel group: every rank (``world_group()``)."""
        ...

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""
        ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int:
        """Processes per node as Lightning counts them (``devices``)."""
        ...


def world_group() -> dist.ProcessGroup:
    """The default process group, every rank of the run: the one both front doors shard over."""
    group = dist.group.WORLD
    assert group is not None, "the process group is created in setup_environment()"
    return group
