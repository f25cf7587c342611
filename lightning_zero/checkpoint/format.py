"""The sharded checkpoint's layout: a directory of DCP shards plus a table of contents, and the DCP glue for it.

    epoch=0-step=8.ckpt/            one directory per checkpoint (the name Lightning picked)
      __0_0.distcp, __1_0.distcp    each rank's tensors, written by torch.distributed.checkpoint (DCP)
      .metadata                     DCP's index: every tensor, its chunks, and which file and byte range holds each
      lightning_state.pt            rank 0: Lightning's own state + the table of contents ("lightning_zero" key)

On a remote URL the DCP files (``.distcp`` and ``.metadata``) are in a subdirectory ``data-<token>/`` that the table
of contents names, and ``lightning_state.pt`` beside it is written last: Note [commit on an object store] in
``storage.py``. A local checkpoint copied to a remote URL as it is (no ``data`` entry) loads too.

Every tensor is stored under a *storage key* (``model_key``, ``master_key``, ``optimizer_key``). A parameter, its
fp32 master and each element-wise optimizer state are stored *flattened*: a 1-D tensor of ``numel`` elements, to
which each rank contributes the contiguous range it owns as one DCP chunk (``FlatChunk``). Ranges are arbitrary (a
parameter may straddle ranks), and loading asks DCP for whatever ranges the *loading* rank owns: DCP reads the
overlapping byte ranges of the saved chunks, which is what lets any world size and stage load any other.

The table of contents (``lightning_state.pt["lightning_zero"]``):

    format_version  int
    state_dict      {LightningModule.state_dict() key: storage key}; tied parameters share one storage key
    tensors         {storage key: {"shape": [...], "dtype": "float32", "flat": bool}}; flat: stored 1-D, chunked
    masters         {model storage key: master storage key}, for low-precision parameters with fp32 masters
    optimizers      [{parameter FQN: {optimizer state name: storage key}}], one per optimizer
    files           {shard file name: CRC-32}, checked before a file is first read
    averaged        {state_dict key: storage key} of a full averaged copy of the model kept by Lightning's
                    ``WeightAveraging`` callbacks (stages 1 and 2), stored whole (not flat); absent or empty otherwise
    saved_with      {"world_size": int, "stage": int}, for people reading the file
    data            (remote checkpoints only) the name of the subdirectory holding the DCP files
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType

from lightning_zero.checkpoint.files import (
    DCP_METADATA_FILE,
    LIGHTNING_STATE_FILE,
    CheckpointError,
    CheckpointNotFoundError,
    load_lightning_state,
    read_metadata,
)
from lightning_zero.checkpoint.storage import DATA_PREFIX, Location

FORMAT_VERSION = 1
TOC_KEY = "lightning_zero"
"""Key of the table of contents inside ``lightning_state.pt``."""

Toc = dict[str, Any]


def model_key(state_dict_key: str) -> str:
    return f"model/{state_dict_key}"


def master_key(fqn: str) -> str:
    return f"master/{fqn}"


def optimizer_key(optimizer_index: int, fqn: str, state_name: str) -> str:
    return f"optim/{optimizer_index}/{fqn}/{state_name}"


def averaged_key(state_dict_key: str) -> str:
    return f"averaged/{state_dict_key}"


def empty_toc() -> Toc:
    return {
        "format_version": FORMAT_VERSION,
        "state_dict": {},
        "tensors": {},
        "masters": {},
        "optimizers": [],
        "files": {},
        "averaged": {},
    }


def tensor_info(shape: torch.Size, dtype: torch.dtype, flat: bool) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "flat": flat}


def info_dtype(info: Mapping[str, Any]) -> torch.dtype:
    dtype = getattr(torch, str(info["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"Unknown dtype {info['dtype']!r} in the checkpoint's table of contents.")
    return dtype


# -- what DCP writes and fills ---------------------------------------------------------------------------------------
class FlatChunk:
    """Elements ``[offset, offset + local.numel())`` of a flattened tensor of ``numel`` elements (full ``shape``).

    DCP's extension protocol (``__create_write_items__`` / ``__create_chunk_list__``, as DTensor implements it): on
    save the chunk is written as one shard of the 1-D tensor (``data()``, asked for when it is written); on load it is
    the destination that DCP fills from the overlapping saved chunks, piece by piece (``destination``, then
    ``commit``). ``checkpoint/tiered.py``'s ``SpanChunk`` moves the same pieces through the memory tiers.
    """

    __slots__ = ("local", "offset", "shape")

    def __init__(self, local: Tensor, offset: int, shape: torch.Size) -> None:
        assert local.dim() == 1, "a chunk of a flattened tensor is 1-D"
        assert offset >= 0, "the chunk lies inside the tensor"
        assert offset + local.numel() <= shape.numel(), "the chunk lies inside the tensor"
        self.local = local
        self.offset = offset
        self.shape = shape

    @property
    def numel(self) -> int:
        return self.local.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def properties(self) -> TensorProperties:
        return TensorProperties.create_from_tensor(self.local)

    def data(self) -> Tensor:
        """This rank's elements, as a save writes them (a view; the writer copies it into a storage of its own)."""
        return self.local

    def destination(self, start: int, numel: int) -> Tensor:
        """Where a load puts elements ``[start, start + numel)`` of the chunk (counted from its own first one)."""
        return self.local[start : start + numel]

    def commit(self, start: int, values: Tensor) -> None:
        """``destination(start, ...)`` holds ``values`` now (in place here: nothing left to do)."""

    def size(self) -> torch.Size:
        return torch.Size([self.shape.numel()])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.numel]))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        if self.numel == 0:  # this rank owns none of it: the owners write it
            return []
        chunk = self._chunk()
        data = TensorWriteData(chunk=chunk, properties=self.properties(), size=self.size())
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner (deduplicates replicated tensors across ranks) that also resolves ``FlatChunk``s, each
    when the writer gets to it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        return value.data() if isinstance(value, FlatChunk) else super().lookup_object(index)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Fills ``FlatChunk`` destinations and refuses pickled (non-tensor) records (Note [safe loading])."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        chunks = {key: value for key, value in state_dict.items() if isinstance(value, FlatChunk)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)  # DCP's meta-tensor initialization replaces objects it does not know with None

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        value = self.state_dict[read_item.dest_index.fqn]
        if isinstance(value, FlatChunk):
            return value.destination(read_item.dest_offsets[0], read_item.lengths[0])
        return super().resolve_tensor(read_item)  # type: ignore[no-any-return]

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        value = self.state_dict[read_item.dest_index.fqn]
        if isinstance(value, FlatChunk):
            value.commit(read_item.dest_offsets[0], tensor)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(
            f"Refusing to unpickle checkpoint entry {read_item.dest_index.fqn!r}: lightning_zero checkpoints hold "
            "only tensors. HINT: this entry was not written by lightning_zero; do not load untrusted files."
        )


# -- the table of contents -------------------------------------------------------------------------------------------
def build_toc(
    model_state: Mapping[str, FlatChunk | Tensor],
    optimizer_states: list[dict[str, Any]],
    averaged: Mapping[str, Tensor] | None = None,
    masters_of: Mapping[str, str] | None = None,
) -> tuple[dict[str, FlatChunk | Tensor], Toc]:
    """What this rank hands DCP (storage key -> chunk or replicated tensor) and its part of the table of contents.

    ``averaged``: the full state dict of a ``WeightAveraging`` callback's averaged model, the same on every rank.
    ``masters_of``: {``model_state`` key: parameter FQN} for the entries whose exact values are that parameter's fp32
    master (Note [checkpoint hooks see the model's values] in ``model_entries.py``); None: each FQN's own key."""
    tensors: dict[str, FlatChunk | Tensor] = {}
    toc = empty_toc()

    def add(key: str, entry: FlatChunk | Tensor, flat: bool) -> None:
        if isinstance(entry, FlatChunk):
            tensors[key], shape, dtype = entry, entry.shape, entry.dtype
        else:
            tensors[key], shape, dtype = (entry.reshape(-1) if flat else entry), entry.shape, entry.dtype
        toc["tensors"][key] = tensor_info(shape, dtype, flat)

    storage_of: dict[int, str] = {}
    for key, entry in model_state.items():
        if id(entry) not in storage_of:
            storage_of[id(entry)] = model_key(key)
            add(model_key(key), entry, flat=True)
        toc["state_dict"][key] = storage_of[id(entry)]
    for i, optimizer_state in enumerate(optimizer_states):
        for fqn, chunk in optimizer_state.get("masters", {}).items():
            add(master_key(fqn), chunk, flat=True)
            if masters_of is None:
                toc["masters"][model_key(fqn)] = master_key(fqn)
        names: dict[str, dict[str, str]] = {}
        for fqn, entries in optimizer_state.get("state", {}).items():
            for name, entry in entries.items():
                add(optimizer_key(i, fqn, name), entry, flat=isinstance(entry, FlatChunk))
                names.setdefault(fqn, {})[name] = optimizer_key(i, fqn, name)
        toc["optimizers"].append(names)
    for key, fqn in (masters_of or {}).items():  # an entry renamed by a hook keeps its master
        if key in toc["state_dict"] and master_key(fqn) in toc["tensors"]:
            toc["masters"][toc["state_dict"][key]] = master_key(fqn)
    stored: dict[int, str] = {}
    for key, value in (averaged or {}).items():
        if id(value) not in stored:  # tied weights: stored once
            stored[id(value)] = averaged_key(key)
            add(averaged_key(key), value.detach(), flat=False)
        toc["averaged"][key] = stored[id(value)]
    return tensors, toc


def merge_tocs(tocs: list[Toc], saved_with: Mapping[str, int]) -> Toc:
    """Every rank lists what it wrote; together they describe the whole checkpoint."""
    merged = empty_toc()
    for toc in tocs:
        for key, storage in toc["state_dict"].items():
            merged["state_dict"].setdefault(key, storage)
        merged["tensors"].update(toc["tensors"])
        merged["masters"].update(toc["masters"])
        merged["files"].update(toc["files"])
        merged["averaged"].update(toc["averaged"])
        for i, names in enumerate(toc["optimizers"]):
            if i == len(merged["optimizers"]):
                merged["optimizers"].append({})
            for fqn, entries in names.items():
                merged["optimizers"][i].setdefault(fqn, {}).update(entries)
    merged["saved_with"] = dict(saved_with)
    return merged


def checked_toc(toc: object, origin: Location) -> Toc:
    if not isinstance(toc, dict) or toc.get("format_version") != FORMAT_VERSION:
        found = toc.get("format_version") if isinstance(toc, dict) else None
        raise CheckpointError(
            f"{origin} has no lightning_zero table of contents of format version {FORMAT_VERSION} (found "
            f"{found!r}). HINT: pass a checkpoint directory written by ZeroStrategy, or a single .ckpt file."
        )
    data = toc.get("data")
    if data is not None and (not isinstance(data, str) or not data.startswith(DATA_PREFIX) or "/" in data):
        raise CheckpointError(
            f"{origin} names {data!r} as its data directory; expected a name {DATA_PREFIX}<token> inside the "
            "checkpoint. HINT: the file was modified; use another checkpoint."
        )
    return toc


def data_directory(toc: Toc, checkpoint: Location) -> Location:
    """Where the DCP files of ``checkpoint`` are: the directory itself, or the data directory its commit named."""
    data = toc.get("data")
    return checkpoint if data is None else checkpoint / data


def check_toc_against_metadata(toc: Toc, metadata: Metadata, directory: Location) -> None:
    """Both index files must describe the same tensors, or they come from different saves."""
    for key, info in toc["tensors"].items():
        entry = metadata.state_dict_metadata.get(key)
        expected = torch.Size([math.prod(info["shape"])] if info["flat"] else info["shape"])
        if not isinstance(entry, TensorStorageMetadata) or entry.size != expected:
            found = "missing" if entry is None else f"{type(entry).__name__} {getattr(entry, 'size', '')}"
            raise CheckpointError(
                f"Checkpoint entry {key!r} is {found} in {directory / DCP_METADATA_FILE}, but the "
                f"{LIGHTNING_STATE_FILE} beside it expects a tensor of size {tuple(expected)}. HINT: the files of "
                "this directory come from different saves or were modified; use a complete checkpoint."
            )


def open_committed(checkpoint: Location) -> tuple[dict[str, Any], Toc, Location, Metadata]:
    """A committed checkpoint directory's Lightning state (without its table of contents), the checked table of
    contents, its data directory and DCP metadata, checked against each other; a clear error for anything else."""
    if not (checkpoint / LIGHTNING_STATE_FILE).isfile():
        found = checkpoint.exists()
        what = f"has no {LIGHTNING_STATE_FILE}, so it is not a checkpoint" if found else "does not exist"
        raise (CheckpointError if found else CheckpointNotFoundError)(
            f"Checkpoint path {checkpoint} {what}. HINT: pass a directory written by ZeroStrategy (an interrupted "
            "save never leaves one under its final name, nor commits one on a remote URL) or a single .ckpt file."
        )
    state = load_lightning_state(checkpoint / LIGHTNING_STATE_FILE)
    toc = checked_toc(state.pop(TOC_KEY, None), checkpoint / LIGHTNING_STATE_FILE)
    data = data_directory(toc, checkpoint)
    metadata = read_metadata(data)
    check_toc_against_metadata(toc, metadata, data)
    return state, toc, data, metadata
