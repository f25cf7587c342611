"""Where checkpoint files live: a local path or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

``Location`` is one file or directory on one filesystem; ``locate`` turns what a user passes (a path, a
``file://`` URL or a remote URL) into one. Local paths keep the local commit (a rename, Note [atomic commit] in
``local_commit.py``); remote ones commit as Note [commit on an object store] says.

Note [commit on an object store]
An object store has no directories and no atomic rename (S3's and GCS's "rename" copies, then deletes, object by
object), so a checkpoint cannot be written aside and renamed into place. What every object store does guarantee is
that a single object write (a PUT, or a multipart upload when it is completed) is atomic: readers see the old
object or the new one, never a part. So a save of ``<name>`` on a remote URL:

1. every rank writes its DCP files into a fresh ``<name>/data-<token>/``, next to whatever ``<name>`` holds now
   (the previous checkpoint's ``lightning_state.pt`` and its own ``data-<other>/``, which nothing touches);
2. once DCP has finished every rank's files and ``.metadata``, rank 0 writes ``<name>/lightning_state.pt`` with one
   PUT (serialized in memory first, so an error while serializing uploads nothing). Its table of contents names the
   data directory (``"data": "data-<token>"``) and the CRC-32 of every shard file: this write is the commit;
3. only then are the previous save's data and any leftovers of interrupted saves deleted.

A loader reads ``lightning_state.pt`` first and only the data directory it names, so at every instant ``<name>`` is
the previous complete checkpoint or the new one. A crash before step 2 leaves an unreferenced ``data-<token>/``
(ignored by loaders, deleted by the next save of the same name); a directory with no ``lightning_state.pt`` is
refused as "not a checkpoint". Removal deletes ``lightning_state.pt`` first, so a half-deleted checkpoint is never
offered either. Files are written with ``sync_files=False``: on an object store a file exists only once its upload
completed, and there is nothing to fsync.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch import Tensor
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_zero.compat import FsspecWriter, write_dcp_item, writes_torch_save

WriteFiles = Callable[
    [list[tuple[str, str, list[WriteItem]]], SavePlanner, bool], tuple[list[list[WriteResult]], dict[str, int]]
]
"""Writes DCP's files ``(path, storage key, items)`` as ``planner`` resolves the items, fsynced if asked; gives each
file's ``WriteResult``s and the CRC-32 of each file by name."""

DATA_PREFIX = "data-"
"""Name prefix of a remote checkpoint's data directory (Note [commit on an object store])."""


@dataclass(frozen=True)
class Location:
    """One file or directory: ``path`` on ``fs`` (without the protocol); ``url`` is how messages name it."""

    fs: AbstractFileSystem
    path: str
    url: str

    @property
    def remote(self) -> bool:
        return not isinstance(self.fs, LocalFileSystem)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def local(self) -> Path:
        assert not self.remote, "only a local location is a Path"
        return Path(self.path)

    def __truediv__(self, name: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.url.rstrip('/')}/{name}")

    def __str__(self) -> str:
        return self.url

    def open(self, mode: str = "rb") -> IO[bytes]:
        opened: IO[bytes] = self.fs.open(self.path, mode)
        return opened

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def isfile(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def size(self) -> int:
        """Bytes of the file; ``FileNotFoundError`` if there is none."""
        return int(self.fs.size(self.path))

    def forget_listings(self) -> None:
        # s3fs & co. cache directory listings per process: another rank's (or process's) writes would stay unseen.
        self.fs.invalidate_cache(self.path)


def locate(path: str | os.PathLike[str]) -> Location:
    """A local path or ``file://`` URL becomes a local location; any other ``protocol://`` URL a remote one."""
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        local = Path(text.removeprefix("file://"))
        return Location(LocalFileSystem(), str(local), str(local))
    try:
        fs, stripped = url_to_fs(text)
    except (ImportError, ValueError) as error:  # an unknown protocol, or its package is not installed
        raise ValueError(
            f"Invalid checkpoint path: {text!r} ({error}). Expected a local path or an fsspec URL whose filesystem "
            "is installed. HINT: install the package of its protocol (s3fs for s3://, gcsfs for gs://, adlfs for "
            "az://)."
        ) from error
    return Location(fs, stripped, text.rstrip("/"))


# -- writing ---------------------------------------------------------------------------------------------------------
class _Crc32Stream:
    """A write stream that computes the CRC-32 of what goes through it (DCP calls write, tell, fileno and close)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.crc = 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        written: int = self._stream.write(data)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _ChecksummedFiles:
    """DCP's fsspec filesystem adapter, recording the CRC-32 of every file written (keyed by file name)."""

    def __init__(self, files: Any, checksums: dict[str, int]) -> None:
        self._files = files
        self._checksums = checksums

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with self._files.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            tracked = _Crc32Stream(stream)
            yield tracked
        self._checksums[os.path.basename(os.fspath(path))] = tracked.crc


class ChecksummingWriter(FsspecWriter):
    """DCP's ``FsspecWriter`` (one file per rank) that records each shard file's CRC-32 while writing it, so that
    nothing is read back (from an object store that would be a second download) to checksum it, and that writes one
    tensor at a time.

    Note [one tensor at a time]
    DCP's writer (``filesystem._write_files_from_queue``, torch 2.13) asks the planner for each tensor as it writes
    it, copies a view into a storage of its own (``torch.save`` of a view would write the whole storage), and then
    keeps every tensor it wrote in a dict until the file is closed (for its safetensors format). Every chunk we save
    is a view of a shard, so a save would hold a copy of this rank's whole model state at its end, and with memory
    tiers it would hold what was meant to stay on disk (Note [checkpoints stream through the tiers] in
    ``tiered.py``). ``_write_data`` writes the same files with DCP's own ``_write_item`` (same bytes, same
    ``WriteResult``s), one tensor after the other, dropping each once written: a save holds one chunk at a time.
    Torch 2.6's writer has no ``_write_data`` (``compat.DCP_WRITER_HAS_WRITE_DATA``) and keeps nothing: it resolves
    and writes one tensor at a time itself (on a GPU machine, copying up to 10 MB ahead), so there it runs as it is.
    """

    fs: Any

    def __init__(self, directory: Location, write_files: WriteFiles | None = None) -> None:
        # fsync only where there is a local disk to sync; an uploaded object is durable once it exists.
        super().__init__(directory.url, single_file_per_rank=True, sync_files=not directory.remote)
        self.checksums: dict[str, int] = {}
        self.fs = _ChecksummedFiles(self.fs, self.checksums)
        self.write_files = write_files
        """Writes the files elsewhere (Note [writer process] in ``async_save.py``); None: here, one at a time."""

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue[Any]) -> Future[list[WriteResult]]:
        """Note [one tensor at a time]; what DCP's ``_write_files_from_queue`` does with one thread, in plan order."""
        assert writes_torch_save(self), "sharded checkpoints use torch.save"
        files: list[tuple[str, str, list[WriteItem]]] = []
        while not file_queue.empty():
            path, storage_key, items = file_queue.get_nowait()
            files.append((path, storage_key, sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)))  # as DCP
        results: list[WriteResult] = []
        if self.write_files is not None:
            written, checksums = self.write_files(files, planner, self.sync_files)
            self.checksums.update(checksums)
            results = [r for file in written for r in file]
            done: Future[list[WriteResult]] = Future()
            done.set_result(results)
            return done
        for path, storage_key, items in files:
            with self.fs.create_stream(path, "wb") as stream:
                for item in items:
                    data = planner.resolve_data(item)
                    if isinstance(data, Tensor):
                        data = data.detach().cpu()
                        if data.untyped_storage().nbytes() != data.nbytes:
                            data = data.clone()  # only this tensor's bytes: as DCP does
                    results.append(write_dcp_item(self, stream, data, item, storage_key))
                    del data
                if self.sync_files:
                    try:
                        os.fsync(stream.fileno())
                    except (AttributeError, io.UnsupportedOperation):
                        os.sync()
        done = Future()
        done.set_result(results)
        return done

    def shard_checksums(self) -> dict[str, int]:
        """CRC-32 of the shard files this rank wrote (DCP's own ``.metadata`` is validated, not checksummed)."""
        return {name: crc for name, crc in self.checksums.items() if not name.startswith(".")}


def new_data_directory(target: Location) -> Location:
    return target / f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}"


def put_atomically(data: bytes, target: Location) -> None:
    """One object write: readers see the old object or the new one (Note [commit on an object store])."""
    target.fs.pipe_file(target.path, data)


def serialized(save: Any) -> bytes:
    """The bytes ``save(stream)`` writes, produced in memory before anything is uploaded."""
    buffer = io.BytesIO()
    save(buffer)
    return buffer.getvalue()


def remove_stale_data(checkpoint: Location, committed: str) -> None:
    """Delete the data of a remote ``checkpoint``'s earlier and interrupted saves: every ``data-*`` directory but
    ``committed``, and the DCP files of a local-layout checkpoint copied there. Nothing else in it is touched."""
    checkpoint.forget_listings()
    with contextlib.suppress(FileNotFoundError):
        for entry in checkpoint.fs.ls(checkpoint.path, detail=False):
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            ours = name.startswith(DATA_PREFIX) or name.startswith(".metadata") or name.endswith(".distcp")
            if ours and name != committed:
                checkpoint.fs.rm(entry, recursive=True)
