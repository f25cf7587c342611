"""``ArchiveRecords``: the storage records of a ``torch.save`` archive written by the full checkpoint
(``full_save.py``), and the pickler that refers to them.

The pickled checkpoint names one record per tensor: a ``DeferredTensor`` for a full tensor whose data is gathered
from the shards after the pickle, an in-memory record for a tensor rank 0 holds (Note [full checkpoint streamed] in
``full_save.py``). Low-precision floating tensors are written in fp32, as ``consolidate`` does.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Collection, Hashable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_zero.compat import rebuild_tensor, storage_type

PICKLE_PROTOCOL = 2  # torch.save's default


class Record(NamedTuple):
    """A storage record of the archive (``data/<key>``): ``numel`` elements of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int


class DeferredTensor:
    """A full tensor of the file whose data is gathered from the shards after the pickle (Note [full checkpoint
    streamed]); pickled as ``torch.save`` pickles a contiguous tensor."""

    def __init__(self, record: Record, shape: torch.Size) -> None:
        self.record = record
        self.shape = shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stride = torch.empty(self.shape, device="meta").stride()
        return rebuild_tensor, (self.record, 0, tuple(self.shape), stride, False, collections.OrderedDict())


class RecordPickler(pickle.Pickler):
    """torch.save's pickler: storages as persistent ids; in-memory tensors become records written from memory."""

    def __init__(self, stream: io.BytesIO, records: ArchiveRecords) -> None:
        super().__init__(stream, protocol=PICKLE_PROTOCOL)
        self.records = records

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Record):
            return ("storage", storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return NotImplemented
        return self.records.in_memory(obj).__reduce_ex__(PICKLE_PROTOCOL)


class ArchiveRecords:
    """The archive's storage records, keyed as they are met: gathered ones by what they hold, in-memory ones (rank 0's
    tensors) by the tensor."""

    def __init__(self, as_left: Collection[int] = ()) -> None:
        self.as_left = as_left
        """The ``id`` of tensors written in their own dtype (a checkpoint hook's: Note [checkpoint hooks see the
        model's values] in ``model_entries.py``)."""
        self.known: dict[Hashable, Record] = {}
        self.memory: dict[str, Tensor] = {}
        self.written: set[str] = set()
        self._alive: list[Tensor] = []  # the in-memory tensors whose ids key ``known``

    def deferred(self, what: Hashable, shape: torch.Size, dtype: torch.dtype) -> DeferredTensor:
        if what not in self.known:
            self.known[what] = Record(str(len(self.known)), dtype, shape.numel())
        return DeferredTensor(self.known[what], shape)

    def in_memory(self, tensor: Tensor) -> DeferredTensor:
        what = ("memory", id(tensor))
        if what not in self.known:
            data = tensor.detach().cpu()
            data = (data if id(tensor) in self.as_left else data.to(written_dtype(data.dtype))).contiguous()
            if data.storage_offset() or data.untyped_storage().nbytes() != data.nbytes:
                data = data.clone()  # a record holds this tensor's bytes alone, as torch.save's would
            self.known[what] = Record(str(len(self.known)), data.dtype, data.numel())
            self.memory[self.known[what].key] = data
            self._alive.append(tensor)
        return DeferredTensor(self.known[what], tensor.shape)

    def missing(self) -> list[str]:
        return sorted(set(r.key for r in self.known.values()) - self.written - set(self.memory), key=int)


def written_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision floating tensors are written in fp32 (Note [full checkpoint streamed])."""
    return torch.float32 if dtype.is_floating_point and dtype.itemsize < 4 else dtype
