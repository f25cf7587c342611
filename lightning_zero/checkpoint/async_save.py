"""``ZeroConfig.async_save``: a sharded save written in the background (a thread and a writer process) while training
goes on.

Note [asynchronous save]
A save has two parts: copying what this rank owns out of the live state, and writing and committing it. The copy
must see the state of the step the save was asked at; the writing needs only the copy. ``AsyncSaver.save`` therefore
copies, on the training thread, every chunk and tensor this rank writes (``prepare_save``'s views of the shards,
masters and optimizer state) into host staging buffers, and Lightning's other state with ``deepcopy``, and returns;
a thread then runs the unchanged writer and commit (``write_save``: staged directory, DCP's write, checksums, the
table of contents, rank 0's commit, the barrier), so the commit protocol, its fault guarantees and the format are
those of a synchronous save. Its collectives go over a process group of their own (gloo), so they never interleave
with the training's collectives on the same communicator; the strategy creates it at setup (collective, a fraction
of a second under gloo), so that the first save does not stall the step it follows.

The staging buffers (``HostStaging``) are kept from one save to the next and filled with one ``copy_`` per entry:
as much host memory as what the rank writes, 16Ψ/N bytes for fp32 Adam at stage 3, held from the first save until
the end of training (allocating it afresh at every save would fault every page in again, on the training thread).
From a GPU each copy is a synchronous device-to-host copy into that memory (written for CUDA, not yet run on one).

Note [writer process]
A thread of the training process that writes a checkpoint competes with the training thread for the GIL, and
``torch.save`` holds it while it builds each record (the zip archive's CRC and copies, in C++, for every byte). On
cores that are all busy, such a thread is often descheduled while it holds the GIL, and the training thread waits
for the scheduler as well; on a GPU node, every kernel launch needs the GIL. Writing 150 MB per rank, the writer
thread used 0.27 s of CPU per save in the training process; now 0.05 s (``benchmarks/async_save.py``, ``bench25m``).
The bytes are written by a process of their own (``write_worker.py``, started at the first save; it imports torch
only): the staging memory is an anonymous ``memfd`` that it maps through ``/proc/<pid>/fd``, the writer thread hands
it each file's records by name (DCP's ``WriteItem``s, which the planner resolves to staging buffers), and it writes
them as DCP's ``_write_item`` does (``torch.save`` per record, the same bytes: ``tests/test_async_save.py``
compares them), with the file's CRC-32 and ``fsync``, and answers each record's offset and length, from which the
writer thread builds DCP's ``WriteResult``s. Everything else stays on the writer thread: DCP's planning and
collectives, the table of contents, rank 0's commit and the barrier, so the commit protocol is unchanged, and the
thread mostly waits with the GIL released. The process dies with the training process (``PR_SET_PDEATHSIG``), so a
rank killed during a write commits nothing, as before; a writer process lost fails the save on every rank, which
commits nothing. Remote URLs (fsspec filesystems live in one process) and systems without ``memfd_create`` write
from the thread itself.

At most one save is in flight: a save, a load, a removal of a checkpoint and the end of training first wait for the
one in flight and raise its error, on every rank. A removal asked while a save is in flight (``ModelCheckpoint``
dropping the previous best right after saving the new one) runs on the writer's thread once the new checkpoint is
committed, so that a rank killed during the write leaves the last committed checkpoint in place: nothing already
committed is lost. Not with the disk tier (a snapshot would read every tier file into memory; the tiers stream
saves instead: Note [checkpoints stream through the tiers]) nor with ``state_dict_type="full"`` (rank 0 assembles
one file from every rank's pieces as they arrive): both are refused at setup.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import mmap
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from lightning_zero.checkpoint.files import refuse_replacing_other_files, refuse_unloadable_state
from lightning_zero.checkpoint.format import FlatChunk, Toc
from lightning_zero.checkpoint.sharded_checkpoint import prepare_save, write_save
from lightning_zero.checkpoint.storage import locate
from lightning_zero.compat import StorageInfo

Layout = list[tuple[str, int, torch.dtype, torch.Size]]
"""Staging buffers as ``(key, byte offset, dtype, shape)``."""

_ALIGNMENT = 64


class HostStaging:
    """Host copies of what one rank writes, reused from save to save (Note [asynchronous save]): views of one block of
    memory, shared with the writer process where there is one (an anonymous ``memfd``, which no crash leaves behind).
    """

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.layout: Layout = []
        self.fd: int | None = None
        self.size = 0
        self.generation = 0
        """Counts the blocks of memory made: the writer process maps each once."""
        self._buffers: dict[str, Tensor] = {}
        self._keys: dict[int, str] = {}

    def snapshot(self, tensors: Mapping[str, FlatChunk | Tensor]) -> dict[str, FlatChunk | Tensor]:
        """``tensors`` copied into the staging buffers, as of now; the buffers of the previous snapshot are
        overwritten, so its write must be done."""
        sources = {key: (e.local if isinstance(e, FlatChunk) else e).detach() for key, e in tensors.items()}
        if [(k, d, s) for k, _, d, s in self.layout] != [(k, t.dtype, t.shape) for k, t in sources.items()]:
            self._allocate(sources)
        snapshot: dict[str, FlatChunk | Tensor] = {}
        for key, entry in tensors.items():
            buffer = self._buffers[key]
            buffer.copy_(sources[key])  # from a GPU: one synchronous copy each, done before the step goes on
            snapshot[key] = FlatChunk(buffer, entry.offset, entry.shape) if isinstance(entry, FlatChunk) else buffer
        return snapshot

    def key_of(self, data: Tensor) -> str | None:
        """The staging buffer ``data`` is, if it is one."""
        key = self._keys.get(data.data_ptr())
        if key is None or self._buffers[key].shape != data.shape or self._buffers[key].dtype != data.dtype:
            return None
        return key

    def _allocate(self, sources: Mapping[str, Tensor]) -> None:
        self.close()
        offset = 0
        for key, source in sources.items():
            self.layout.append((key, offset, source.dtype, source.shape))
            offset += -(-source.nbytes // _ALIGNMENT) * _ALIGNMENT
        self.size, self.generation = max(offset, 1), self.generation + 1
        if self.shared:
            self.fd = os.memfd_create("lightning_zero-async-save")
            os.ftruncate(self.fd, self.size)
            memory: Any = mmap.mmap(self.fd, self.size)
        else:
            memory = bytearray(self.size)
        for key, at, dtype, shape in self.layout:
            nbytes = shape.numel() * dtype.itemsize
            # One storage per entry, exactly its bytes: torch.save writes a tensor's whole storage.
            flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=at) if nbytes else torch.empty(0)
            self._buffers[key] = flat.view(dtype).view(shape)
            self._keys[self._buffers[key].data_ptr()] = key

    def close(self) -> None:
        self.layout, self._buffers, self._keys = [], {}, {}
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class WriterProcess:
    """The process that writes an asynchronous save's local files from the staging memory (Note [writer process])."""

    def __init__(self) -> None:
        script = Path(__file__).with_name("write_worker.py")
        run = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
        self._process = subprocess.Popen(
            [sys.executable, "-c", run, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._mapped = 0

    def write_files(
        self, staging: HostStaging, files: list[tuple[str, str, list[WriteItem]]], planner: SavePlanner, sync: bool
    ) -> tuple[list[list[WriteResult]], dict[str, int]]:
        """``WriteFiles``: the staged tensors are named, anything else (DCP's bytes) is sent."""
        if self._mapped != staging.generation:
            self._ask(("map", os.getpid(), staging.fd, staging.size, staging.layout))
            self._mapped = staging.generation
        request = []
        for path, _, items in files:
            records: list[tuple[str, Any]] = []
            for item in items:
                data = planner.resolve_data(item)
                if isinstance(data, Tensor):
                    key = staging.key_of(data)
                    records.append(("staged", key) if key is not None else ("tensor", data.detach().cpu().clone()))
                else:
                    records.append(("bytes", data.getvalue()))
            request.append((path, records))
        answers = self._ask(("write", request, sync))
        results = []
        checksums = {}
        for (path, storage_key, items), (spans, crc) in zip(files, answers, strict=True):
            results.append(  # what DCP's _write_item gives for a torch.save record without extensions
                [
                    WriteResult(index=i.index, size_in_bytes=n, storage_data=StorageInfo(storage_key, at, n))
                    for i, (at, n) in zip(items, spans, strict=True)
                ]
            )
            checksums[os.path.basename(path)] = crc
        return results, checksums

    def _ask(self, request: tuple[Any, ...]) -> Any:
        assert self._process.stdin is not None, "opened with a pipe"
        assert self._process.stdout is not None, "opened with a pipe"
        try:
            pickle.dump(request, self._process.stdin)
            self._process.stdin.flush()
            status, value = pickle.load(self._process.stdout)
        except (EOFError, OSError) as error:
            raise OSError(f"the checkpoint writer process exited (code {self._process.poll()})") from error
        if status != "ok":
            raise OSError(value)
        return value

    def close(self) -> None:
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):  # asked, not left to the end of its input: a fork may hold the pipe
                pickle.dump(("exit",), self._process.stdin)
                self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()


class AsyncSaver:
    """One rank's asynchronous saves: at most one in flight (Note [asynchronous save])."""

    def __init__(self, timeout: timedelta, process_group: dist.ProcessGroup | None) -> None:
        """Collective over ``process_group`` (the training's; None for one process): creates the group the saves'
        collectives use."""
        self._group: dist.ProcessGroup | None = None
        if process_group is not None:
            ranks = dist.get_process_group_ranks(process_group)
            self._group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        self._staging = HostStaging(shared=hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"))
        self._process: WriterProcess | None = None
        """Started at the first save (it needs no collective, and training without saves needs no process)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._after_commit: list[Callable[[], None]] = []
        self._accepting = False
        """Whether actions may still be queued behind the save in flight (until its writer takes them)."""
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        checkpoint: dict[str, Any],
        path: str | PathLike[str],
        process_group: dist.ProcessGroup | None,
        saved_with: Mapping[str, int],
        averaged: Mapping[str, Tensor] | None = None,
        masters_of: Mapping[str, str] | None = None,
    ) -> None:
        """Snapshot this rank's part of ``checkpoint`` and write it in the background. Collective, like
        ``save_sharded_checkpoint`` (whose ``masters_of`` it takes); it first waits for the save in flight."""
        self.wait()
        refuse_replacing_other_files(locate(path), process_group)  # Note [what a save may replace]
        assert (process_group is None) == (self._group is None), "the saver was made for this process group"
        group = self._group
        rank = 0 if group is None else group.rank()
        tensors, toc = prepare_save(checkpoint, rank, averaged, masters_of)
        refuse_unloadable_state(checkpoint, path, group)  # Note [a save that cannot load back]
        snapshot = self._staging.snapshot(tensors)
        if self._staging.shared and self._process is None:  # its imports run while the thread plans the save
            self._process = WriterProcess()
        state = copy.deepcopy(checkpoint)  # Lightning's own state (loops, callbacks, RNG states) as of this step
        self._accepting = True
        self._thread = threading.Thread(
            target=self._write,
            args=(state, snapshot, toc, path, group, dict(saved_with)),
            name="lightning_zero-async-save",
            daemon=True,
        )
        self._thread.start()

    def _write(
        self,
        state: dict[str, Any],
        snapshot: dict[str, FlatChunk | Tensor],
        toc: Toc,
        path: str | PathLike[str],
        group: dist.ProcessGroup | None,
        saved_with: Mapping[str, int],
    ) -> None:
        try:
            write_files = None
            if self._process is not None:
                process, staging = self._process, self._staging
                write_files = functools.partial(process.write_files, staging)
            with torch.no_grad():
                write_save(state, snapshot, toc, path, group, saved_with, write_files)
        except BaseException as error:  # handed to the training thread at its next wait()
            self._error = error
        with self._lock:
            pending, self._after_commit, self._accepting = self._after_commit, [], False
        if self._error is not None:  # a failed save committed nothing: what it would have replaced stays
            return
        try:
            for action in pending:
                action()
        except BaseException as error:
            self._error = error

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the save in flight is committed (at once when none is)."""
        with self._lock:
            if self._accepting:
                self._after_commit.append(action)
                return
        action()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffers and the checkpoint process group."""
        try:
            self.wait()
        finally:
            self._staging.close()
            if self._process is not None:
                self._process.close()
                self._process = None
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None
