"""Rank 0's buffers on every rank, where DDP would broadcast them: ``BufferBroadcast`` keeps, for one model, whether
its next forward takes them (Note [buffers follow rank 0]); ``broadcast_buffers`` sends them.

Note [buffers follow rank 0]
DDP (``broadcast_buffers=True``) broadcasts rank 0's buffers at the start of a forward of its wrapper when the
previous forward ran with gradients enabled outside ``no_sync`` (and at the first forward of a fit). Under
Lightning, training steps and, during ``fit``, validation steps are forwards of the wrapper; validation runs without
gradients. So the first validation step after training evaluates rank 0's BatchNorm statistics on every rank, the
first training step after validation does not broadcast, and accumulating micro-batches broadcast only at the first
of each window. ``ZeroStrategy`` broadcasts at exactly those points (``ZeroConfig.broadcast_buffers``), in one
coalesced broadcast of every buffer, as DDP does. ``ZeroFabricStrategy`` does the same per set-up model, as Fabric's
DDP wraps each model in a ``DistributedDataParallel`` of its own: at its first forward, and after a forward with
gradients outside its ``no_backward_sync``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.compat import broadcast_coalesced


class BufferBroadcast:
    """Where one model's forwards take rank 0's buffers, as its DDP wrapper's would (Note [buffers follow rank 0])."""

    def __init__(self) -> None:
        self.next_forward = True
        """Whether the next forward starts with rank 0's buffers (a fresh DDP wrapper's first forward does)."""
        self.accumulating = False
        """Inside ``no_sync``: the forward after this one does not broadcast, as DDP's after a ``no_sync`` forward
        does not."""

    def before_forward(self, module: nn.Module, group: dist.ProcessGroup, enabled: bool) -> None:
        """Broadcast before this forward if DDP would (``enabled``: ``ZeroConfig.broadcast_buffers``), and decide
        for the next one."""
        if self.next_forward and enabled:
            broadcast_buffers(module, group)
        self.next_forward = torch.is_grad_enabled() and not self.accumulating

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """The forwards inside accumulate gradients (``block_backward_sync``, ``fabric.no_backward_sync``)."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False


def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Every rank takes rank 0's buffers (Note [buffers follow rank 0])."""
    buffers = list(module.buffers())
    if buffers and group.size() > 1:
        # DDP's own coalesced broadcast, with its default bucket size (250 MiB).
        broadcast_coalesced(group, buffers, 250 * 1024 * 1024, 0)
