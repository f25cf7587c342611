"""Checkpoint files, read without trusting them and written so that a crash never leaves a usable-looking half.

Note [safe loading]
Nothing a user loads may run code from the checkpoint. ``lightning_state.pt`` and DCP's tensor records are read with
``torch.load(weights_only=True)``. DCP's own ``FileSystemReader.read_metadata`` (torch 2.13) reads ``.metadata`` with
a plain ``pickle.load``, which executes whatever a crafted file asks for; ``read_metadata`` here unpickles it with an
allow-list of DCP's metadata dataclasses, ``torch.Size``/dtype/layout lookups and ``pathlib`` paths, refusing
anything else before it is built, and then checks the structure (file names stay inside the directory, every file is
present and long enough). DCP also stores non-tensor values as pickles that ``DefaultLoadPlanner.load_bytes`` opens
with ``weights_only=False``; we never write those and ``SafeLoadPlanner`` refuses to read them.

The local commit itself (Note [atomic commit]) is ``local_commit.py``'s.

Note [a save that cannot load back]
Lightning's own state (loops, callbacks, hyper-parameters, and under Fabric whatever the user's state dictionary
holds besides models and optimizers) is pickled into ``lightning_state.pt``, which every load reads with
``weights_only=True``. An object outside torch's allow-list (a ``DataLoader`` passed in ``fabric.save``'s state, as
LitGPT's pretraining script does with a plain loader, a custom class) pickles without complaint and then makes every
resume fail; one that does not pickle at all (a lambda) used to fail on rank 0 alone, after the other ranks had
written their shards, leaving them to wait in the commit's barrier. So before any rank writes anything, rank 0 saves
that state into memory and loads it back exactly as a resume would, and every rank raises the same error if that
fails, naming the entry. It costs one pickle round trip of that state per save (its ``lightning_state.pt`` is 7 KB
for a Trainer with ``ModelCheckpoint``, ``EarlyStopping`` and a scheduler); the model's and the optimizer's tensors are
in DCP's files, not in it.

Note [what a save may replace]
Lightning's ``save_checkpoint`` overwrites what is at its path: a ``.ckpt`` file, and under FSDP a sharded checkpoint
directory (its full save deletes one). Here every save replaces its path as a whole (the commit exchanges
directories), so a path that is a directory holding anything but a checkpoint's own files (a run directory passed
by mistake, a note left in a checkpoint) would lose those files. A save is therefore refused there, before any rank
writes anything, with FSDP's ``IsADirectoryError`` for a directory that is not a checkpoint; a checkpoint
directory, an empty one, a file or a link is replaced as before, and ``ModelCheckpoint``'s saves never meet the
refusal (they write only checkpoints under their own names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_zero.checkpoint.local_commit import (
    commit,
    partial_sibling,
    remove_local,
    remove_stale_siblings,
    write_synced,
)
from lightning_zero.checkpoint.storage import (
    Location,
    locate,
    new_data_directory,
    put_atomically,
    remove_stale_data,
    serialized,
)
from lightning_zero.compat import FsspecReader, StorageInfo

LIGHTNING_STATE_FILE = "lightning_state.pt"
"""Rank 0's file in a checkpoint directory: Lightning's state and the table of contents; written last."""
DCP_METADATA_FILE = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file or key and what to do."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing is at a checkpoint path: a ``FileNotFoundError``, as Lightning's ``CheckpointIO`` raises for a missing
    ``ckpt_path``, and a ``CheckpointError`` like every other refusal of a checkpoint."""


# -- reading: restricted metadata, validated files, errors that name the file ---------------------------------------
_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    StorageInfo.__module__: frozenset({StorageInfo.__name__}),
    "torch.serialization": frozenset({"_get_layout"}),  # a lookup of torch.strided & co. by name
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of DCP checkpoint metadata")


def read_metadata(directory: Location) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, unpickled with an allow-list and validated (Note [safe loading])."""
    path = directory / DCP_METADATA_FILE
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing, so {directory} is not a complete checkpoint. HINT: a crash during a save leaves no "
            "checkpoint under the final name; pass an earlier checkpoint directory."
        ) from None
    except Exception as error:  # any unpickling failure: truncated, garbage, or a refused global
        raise CheckpointError(
            f"Refused to load corrupted or unsafe checkpoint metadata {path}: {error}. HINT: the file must be the "
            "index DCP wrote; re-copy the checkpoint directory or use another checkpoint."
        ) from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} does not hold DCP checkpoint metadata (found {type(metadata).__name__}).")
    needed: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path if isinstance(info, StorageInfo) else None
        if (
            not isinstance(name, str)
            or not isinstance(index, MetadataIndex)
            or name in ("", ".", "..")
            or name != os.path.basename(name)
            or info.offset < 0
            or info.length < 0
        ):
            raise CheckpointError(f"{path} lists an invalid storage location {info!r} for {index!r}.")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, nbytes in sorted(needed.items()):
        _check_shard_file(directory / name, nbytes, path)
    return metadata


def _check_shard_file(path: Location, nbytes: int, listed_in: Location) -> None:
    try:
        size = path.size()
    except FileNotFoundError:
        raise CheckpointError(
            f"Checkpoint shard file {path} is missing (listed in {listed_in}). HINT: a checkpoint is usable only "
            "complete; copy every file of the directory, or use an earlier checkpoint."
        ) from None
    if size < nbytes:
        raise CheckpointError(
            f"Checkpoint shard file {path} is truncated: {size} bytes, but {listed_in} needs {nbytes}. HINT: the "
            "copy or the disk was interrupted; use an earlier checkpoint."
        )


class SafeReader(FsspecReader):
    """DCP's fsspec reader (local paths and remote URLs alike) over already validated metadata that checks each file's
    CRC-32 (``checksums``, recorded when saving) before its first read and names the file behind any read error.

    On a remote URL, checking a file's CRC-32 reads it once in full before DCP reads the ranges it needs from it."""

    def __init__(self, directory: Location, metadata: Metadata, checksums: Mapping[str, int]) -> None:
        super().__init__(directory.url)
        self._directory = directory
        self._metadata = metadata
        self._checksums = checksums
        self._verified: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._metadata.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            self._verify(name)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as error:
                raise CheckpointError(
                    f"Could not read checkpoint shard file {self._directory / name}: {error}. HINT: the file is "
                    "corrupted; re-copy the checkpoint directory or use an earlier checkpoint."
                ) from error
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _verify(self, name: str) -> None:
        # torch.load does not check the CRCs of its zip records: a flipped bit in tensor data would load silently.
        expected = self._checksums.get(name)
        if name in self._verified or expected is None:
            return
        found = file_crc32(self._directory / name)
        if found != expected:
            raise CheckpointError(
                f"Checkpoint shard file {self._directory / name} is corrupted: its CRC-32 is {found:#010x}, but "
                f"{expected:#010x} was recorded when it was saved. HINT: re-copy the checkpoint or use an earlier one."
            )
        self._verified.add(name)


def file_crc32(path: Location, block: int = 1 << 24) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


def load_lightning_state(path: Location, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a Lightning state file, with errors that name it.

    ``mmap``: map the tensors' bytes instead of reading them, so that a full checkpoint is paged in piece by piece as
    the slices this rank owns are copied out of it (local files only; a remote file is read into memory).
    """
    try:
        if path.remote:
            source: Path | io.BytesIO = io.BytesIO(path.fs.cat_file(path.path))
            mmap = False
        else:
            source = path.local
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"Checkpoint file {path} does not exist.") from None
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"Refused to load {path}: rebuilding it would run code named in the file ({error}). HINT: checkpoints "
            "are loaded with weights_only=True; allow-list classes you trust with "
            "`torch.serialization.add_safe_globals([...])`."
        ) from error
    except Exception as error:
        raise CheckpointError(f"Could not read checkpoint file {path}: {error}. HINT: it is corrupted.") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a Lightning checkpoint dictionary.")
    return state


# -- a save's commit, local (Note [atomic commit]) or remote (Note [commit on an object store]) ---------------------
_CHECKPOINT_FILES = re.compile(rf"{re.escape(LIGHTNING_STATE_FILE)}|{re.escape(DCP_METADATA_FILE)}|__\d+_\d+\.distcp")
"""What a local checkpoint directory holds (Note [what a save may replace])."""


def refuse_replacing_other_files(target: Location, process_group: dist.ProcessGroup | None) -> None:
    """Collective, before anything is written: raise ``IsADirectoryError`` on every rank if saving at ``target``
    would delete files that are not a checkpoint's (Note [what a save may replace])."""
    rank = 0 if process_group is None else process_group.rank()
    refusal: list[str | None] = [None]
    if rank == 0 and not target.remote and target.local.is_dir() and not target.local.is_symlink():
        foreign = sorted(name for name in os.listdir(target.local) if not _CHECKPOINT_FILES.fullmatch(name))
        if foreign:
            refusal[0] = (
                f"Cannot save a checkpoint at {target}: it is a directory holding {len(foreign)} file(s) that are "
                f"not part of a checkpoint ({foreign[:5]}), which the save would delete, as it replaces the whole "
                f"path. HINT: save under a path of its own (e.g. `{target.local / 'checkpoint.ckpt'}`), or move "
                "those files away first."
            )
    if process_group is not None and process_group.size() > 1:
        dist.broadcast_object_list(refusal, src=dist.get_global_rank(process_group, 0), group=process_group)
    if refusal[0] is not None:
        raise IsADirectoryError(refusal[0])


def refuse_unloadable_state(state: Mapping[str, Any], target: object, process_group: dist.ProcessGroup | None) -> None:
    """Collective, before anything is written: raise ``CheckpointError`` on every rank if rank 0's ``state`` (what
    ``lightning_state.pt`` will hold) could not be pickled or would not load back as every load reads it,
    with ``weights_only=True`` (Note [a save that cannot load back])."""
    rank = 0 if process_group is None else process_group.rank()
    refusal: list[str | None] = [None]
    if rank == 0:
        refusal[0] = _unloadable(state, target)
    if process_group is not None and process_group.size() > 1:
        dist.broadcast_object_list(refusal, src=dist.get_global_rank(process_group, 0), group=process_group)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])


def _round_trip_error(obj: object) -> Exception | None:
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)  # exactly as load_lightning_state reads it
    except Exception as error:
        return error
    return None


def _unloadable(state: Mapping[str, Any], target: object) -> str | None:
    error = _round_trip_error(dict(state))
    if error is None:
        return None
    # Name the entry: only on this failure path is each one tried alone.
    key = next((k for k, v in state.items() if _round_trip_error({k: v}) is not None), None)
    what = "the state" if key is None else f"the entry {key!r} (a {type(state[key]).__name__})"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # torch's weights_only message is a page long; its "WeightsUnpickler error: ..." line names the class.
    reason = next((line for line in lines if "Unpickler error" in line), lines[0] if lines else "")
    return (
        f"Cannot save checkpoint {target}: {what} would not load back, as checkpoints load with weights_only=True "
        f"({type(error).__name__}: {reason}). Nothing was written. HINT: save plain values, tensors or the object's "
        "`state_dict()` instead (an object with `state_dict` and `load_state_dict` methods is saved and restored "
        "that way), leave it out of the saved state, or allow-list a class you trust with "
        "`torch.serialization.add_safe_globals([...])` in the runs that save and load."
    )


def stage_save(target: Location) -> Location:
    """Rank 0: the directory every rank writes this save's DCP files into before the commit."""
    if target.remote:
        return new_data_directory(target)
    target.local.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(target.local)
    staged = partial_sibling(target.local)
    staged.mkdir()
    return Location(target.fs, str(staged), str(staged))


def commit_save(state: dict[str, Any], staged: Location, target: Location) -> None:
    """Rank 0, once every rank's files and DCP's ``.metadata`` are written: write ``state`` as
    ``lightning_state.pt`` and make the save the checkpoint ``target``."""
    if target.remote:
        put_atomically(serialized(lambda stream: torch.save(state, stream)), target / LIGHTNING_STATE_FILE)
        remove_stale_data(target, committed=staged.name)  # the previous save's data, interrupted saves' data
    else:
        write_synced(state, staged.local / LIGHTNING_STATE_FILE)
        commit(staged.local, target.local)


def abandon_save(staged: Location, target: Location) -> None:
    """Rank 0, after a failed save: delete its files; the checkpoint ``target`` was never touched."""
    if target.remote:
        with contextlib.suppress(FileNotFoundError):
            staged.fs.rm(staged.path, recursive=True)
    else:
        remove_stale_siblings(target.local)


def remove(checkpoint: str | os.PathLike[str]) -> None:
    """Remove a checkpoint file, directory or link (``local_commit.remove_local``).

    On a remote URL, ``lightning_state.pt`` goes first: without it what is left is never taken for a checkpoint."""
    target = locate(checkpoint)
    if target.remote:
        target.forget_listings()
        with contextlib.suppress(FileNotFoundError):
            target.fs.rm_file((target / LIGHTNING_STATE_FILE).path)
        with contextlib.suppress(FileNotFoundError):
            target.fs.rm(target.path, recursive=True)
        return
    remove_local(target.local)
