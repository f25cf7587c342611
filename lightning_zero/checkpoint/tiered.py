"""Checkpoint IO through the memory tiers: slices of shards whose memory may be on disk, moved one at a time.

Note [checkpoints stream through the tiers]
With memory tiers (``ZeroConfig.offload_*``) a rank's parameter shards, masters and optimizer state live in a tier
file between uses and only a few entries are ever in memory; a model whose model state is larger than RAM trains.
Its checkpoints must not bring that state into memory either. Every tensor a checkpoint saves or fills is a slice of
a tier entry, named here by a ``Span`` (the entry's tensor, which exists even while its memory is on disk, and an
element range): a view cannot be taken of a tensor without memory. ``SpanChunk`` is a ``FlatChunk`` over a span:

- **save**: DCP asks for each chunk's data as it writes it (``SavePlanner.resolve_data``), and the writer writes one
  tensor at a time and lets it go (Note [one tensor at a time] in ``storage.py``), so the chunk reads only its
  slice from the tier file (Note [ranged tier access] in ``offload/tensor_swapper.py``) right then: one
  parameter's slice in memory at a time;
- **load**: DCP reads each saved piece into a staging tensor (``resolve_tensor``) and hands it back
  (``commit_tensor``), which writes it into the entry's region of the tier file, and, for a parameter whose fp32
  master is separate, into the other of the two (``mirror``: the master's exact value, rounded into the parameter
  shard). Optimizer state that does not exist yet (a resume before the first step) is created in the tier, without
  memory (``StateTiers.new_state``), and filled the same way; ``load_full_state_dict`` and full ``.ckpt`` files go
  through the same chunks, from memory-mapped sources.

Peak memory is one saved chunk and one staging piece (at most the largest parameter's slice), not the model state;
the file format is the same as without tiers, so any layout, tier, stage or world size loads any other.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorProperties

from lightning_zero.checkpoint.format import FlatChunk


class TierStorage(Protocol):
    """The memory tiers as checkpoint IO sees them (``lightning_zero.offload.MemoryTiers``): slices of the tensors
    whose memory a tier holds, read and written without making them resident."""

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` (or the tensor it views) is kept in a tier."""
        ...

    def read(self, tensor: Tensor, start: int, numel: int) -> Tensor:
        """A new tensor with elements ``[start, start + numel)`` of ``tensor`` (a 1-D tensor the tiers hold)."""
        ...

    def write(self, tensor: Tensor, start: int, values: Tensor) -> None:
        """Set elements ``[start, start + values.numel())`` of ``tensor`` to ``values``."""
        ...


class Span(NamedTuple):
    """Elements ``[start, start + numel)`` of the 1-D ``tensor``, whose memory may be in a tier (then no view of it
    can be taken)."""

    tensor: Tensor
    start: int
    numel: int

    def tiered(self, tiers: TierStorage | None) -> bool:
        return tiers is not None and tiers.holds(self.tensor)

    def view(self) -> Tensor:
        """The elements as a view (in memory only)."""
        return self.tensor[self.start : self.start + self.numel]

    def read(self, tiers: TierStorage | None) -> Tensor:
        if tiers is not None and self.tiered(tiers):
            return tiers.read(self.tensor, self.start, self.numel)
        return self.view()

    @torch.no_grad()
    def write(self, tiers: TierStorage | None, offset: int, values: Tensor) -> None:
        """Elements ``[offset, offset + values.numel())`` of the span take ``values`` (converted to its dtype)."""
        values = values.to(self.tensor.dtype)
        if tiers is not None and self.tiered(tiers):
            tiers.write(self.tensor, self.start + offset, values)
        else:
            first = self.start + offset
            self.tensor[first : first + values.numel()].copy_(values)


class SpanChunk(FlatChunk):
    """A ``FlatChunk`` whose elements are ``span`` (Note [checkpoints stream through the tiers]); on load each piece
    also goes to ``mirror`` (the parameter shard of a separate master, or the master of a parameter), if any."""

    __slots__ = ("mirror", "span", "tiers")

    def __init__(
        self,
        span: Span,
        offset: int,
        shape: torch.Size,
        tiers: TierStorage | None,
        mirror: Span | None = None,
    ) -> None:
        assert offset >= 0, "the chunk lies inside the tensor"
        assert offset + span.numel <= shape.numel(), "the chunk lies inside the tensor"
        self.span = span
        self.offset = offset
        self.shape = shape
        self.tiers = tiers
        self.mirror = mirror

    @property
    def numel(self) -> int:
        return self.span.numel

    @property
    def dtype(self) -> torch.dtype:
        return self.span.tensor.dtype

    def properties(self) -> TensorProperties:
        return TensorProperties(dtype=self.dtype)

    def data(self) -> Tensor:
        return self.span.read(self.tiers)

    def destination(self, start: int, numel: int) -> Tensor:
        return torch.empty(numel, dtype=self.dtype)

    def commit(self, start: int, values: Tensor) -> None:
        self.span.write(self.tiers, start, values)
        if self.mirror is not None:
            self.mirror.write(self.tiers, start, values)


def chunk_of(
    span: Span, offset: int, shape: torch.Size, tiers: TierStorage | None, mirror: Span | None = None
) -> FlatChunk:
    """A plain ``FlatChunk`` over the span's memory, or a ``SpanChunk`` when a tier holds it or a mirror is kept."""
    if mirror is None and not span.tiered(tiers):
        return FlatChunk(span.view(), offset, shape)
    return SpanChunk(span, offset, shape, tiers, mirror)
