"""``ZeroConfig.async_save``: a sharded save written by a background thread while training goes on.

Note [asynchronous save]
A save has two parts: copying what this rank owns out of the live state, and writing and committing it. The copy
must see the state of the step the save was asked at; the writing needs only the copy. ``AsyncSaver.save`` therefore
copies, on the training thread, every chunk and tensor this rank writes (``prepare_save``'s views of the shards,
masters and optimizer state) and Lightning's other state, into host memory (a snapshot: as much host memory as
what the rank writes, 16Ψ/N bytes for fp32 Adam at stage 3, held until the write is done), and returns; a thread
then runs the unchanged writer and commit (``write_save``: staged directory, DCP's write, checksums, the table of
contents, rank 0's commit, the barrier), so the commit protocol, its fault guarantees and the format are those of a
synchronous save. Its collectives go over a process group of their own (gloo, created collectively at the first
asynchronous save), so they never interleave with the training's collectives on the same communicator.

At most one save is in flight: a save, a load, a removal of a checkpoint and the end of training first wait for the
one in flight and raise its error, on every rank. A removal asked while a save is in flight (``ModelCheckpoint``
dropping the previous best right after saving the new one) runs on the writer's thread once the new checkpoint is
committed, so that a rank killed during the write leaves the last committed checkpoint in place: nothing already
committed is lost. Not with the disk tier (a snapshot would read every tier file into memory; the tiers stream
saves instead: Note [checkpoints stream through the tiers]) nor with ``state_dict_type="full"`` (rank 0 assembles
one file from every rank's pieces as they arrive): both are refused at setup.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from os import PathLike
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.checkpoint.files import refuse_replacing_other_files
from lightning_zero.checkpoint.format import FlatChunk, Toc
from lightning_zero.checkpoint.sharded_checkpoint import prepare_save, write_save
from lightning_zero.checkpoint.storage import locate


def _snapshot(entry: FlatChunk | Tensor) -> FlatChunk | Tensor:
    if isinstance(entry, FlatChunk):
        return FlatChunk(entry.local.detach().to("cpu", copy=True), entry.offset, entry.shape)
    return entry.detach().to("cpu", copy=True)


class AsyncSaver:
    """One rank's asynchronous saves: at most one in flight (Note [asynchronous save])."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None
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
        group = self._checkpoint_group(process_group)
        rank = 0 if group is None else group.rank()
        tensors, toc = prepare_save(checkpoint, rank, averaged, masters_of)
        snapshot = {key: _snapshot(entry) for key, entry in tensors.items()}
        state = copy.deepcopy(checkpoint)  # Lightning's own state (loops, callbacks, RNG states) as of this step
        self._accepting = True
        self._thread = threading.Thread(
            target=self._write,
            args=(state, snapshot, toc, path, group, dict(saved_with)),
            name="lightning_zero-async-save",
            daemon=True,
        )
        self._thread.start()

    def _checkpoint_group(self, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        if process_group is None:
            return None
        if self._group is None:  # collective: every rank's first asynchronous save creates it
            ranks = dist.get_process_group_ranks(process_group)
            self._group = dist.new_group(ranks, timeout=self.timeout, backend="gloo")
        return self._group

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
            with torch.no_grad():
                write_save(state, snapshot, toc, path, group, saved_with)
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
        """Wait for the save in flight and release the checkpoint process group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None
