"""``TensorSwapper``: tensors whose memory lives in a tier file between uses, read ahead and written behind.

A registered tensor keeps its identity (the optimizer's state dict, the masters that view a parameter shard, a
unit's bucket all keep pointing at it); only its storage is resized: to zero bytes when it goes to disk and back to
full size when it is needed, as stage 3 frees gathered parameters (Note [freeing saved views]), so views taken
while it was resident read the right values again once it is back.

Note [swap lifecycle]
Each entry is ``ON_DISK`` (no memory), ``READING`` (memory allocated, a background read filling it), ``RESIDENT``
(usable; ``users`` counts the holders) or ``WRITING`` (a background write draining it; its memory is freed by the
writer once written). ``acquire`` makes an entry resident and counts a user; ``release`` drops one, and the last
user's release writes the entry back only if it was modified (the tensor's version counter moved, which every
in-place op on it or on any view of it does) and then frees it. Nothing is kept resident without a user except what
read-ahead fetched for the uses predicted next.

Note [read-ahead order]
Every step uses the tier entries in the same order (units gathered in forward and backward, buckets stepped), so
the order of ``acquire`` calls in one step predicts the next: each ``acquire`` finds its key in the previous step's
order and starts reading the entries that follow it, up to ``budget_bytes``. That is the prefetch order stage 3
already follows (Note [forward order]), extended to the optimizer's buckets. The first step runs without read-ahead;
a prediction that fails (a step that takes another path) only costs memory until the step ends.

Note [ranged tier access]
A checkpoint reads and writes every tier entry once, in the checkpoint's order, not the step's. Making each entry
resident for that (``acquire``) would read whole entries to save one parameter's slice of them and, done for all of
them at once, hold this rank's whole model state in memory. ``read_range``/``write_range`` instead move the bytes of
one slice between the caller's tensor and wherever the entry's current value is: its memory when it is resident
(a write then makes it dirty, so it is written back as usual), otherwise its region of the file, which is read or
written in place. A clean read-ahead copy is dropped before a ranged write (it would be stale). Nothing becomes
resident, so a save or load holds one slice at a time, and the entries keep their read-ahead order.

Note [stream-ordered reads]
The host tier's store (``HostStore``) reads an entry by a copy to the device on its copy stream, which it returns
as a ``Copy`` instead of a function to run. The swapper never waits for such a read on the host: it issues the copy
on the training thread (read-ahead, or a use nobody predicted) and, when the entry is next needed (``acquire``, or
anything that settles the entry), makes the compute stream wait for the copy's event. The host thus runs ahead of
the device by as many units as read-ahead covers, as the gatherer's prefetch does, while every kernel that uses the
entry (and every reuse of its memory after it is freed, allocated as it was on the compute stream) is ordered after
its copy by the device. The host waits for a read only where the host touches the bytes the copy reads: before a
ranged write into the store (``write_range``), when an entry is replaced (``add``), and in ``flush``. The copy itself
still starts after the compute queued when it was issued (its memory, freshly allocated on the compute stream, may
have been used by that compute), so read-ahead issued at one unit's gather overlaps that unit's compute and all
that follows. On the CPU the copy is done when issued and ordering it is a no-op: nothing changes there.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lightning_zero.offload.host_copies import Copy


class TierStore(Protocol):
    """Where entries live between uses: the disk tier's ``SwapFile``, or the host tier's ``HostStore`` (pinned host
    memory for device tensors, ``host_copies.py``). ``start_read``/``start_write`` begin a move on the calling thread
    and return what finishes it, which the swapper runs on its reader or writer thread; a read may instead return
    the device ``Copy`` it issued, which the swapper orders by stream events (Note [stream-ordered reads])."""

    bytes_read: int
    bytes_written: int

    @property
    def nbytes(self) -> int: ...

    def start_read(self, key: Hashable, tensor: Tensor) -> Callable[[], None] | Copy: ...

    def start_write(self, key: Hashable, tensor: Tensor) -> Callable[[], None]: ...

    def read_range(self, key: Hashable, start: int, out: Tensor) -> None: ...

    def write_range(self, key: Hashable, nbytes: int, start: int, values: Tensor) -> None: ...

    def close(self) -> None: ...


class Residency(enum.Enum):
    """Where an entry's data is (Note [swap lifecycle])."""

    ON_DISK = "on_disk"
    READING = "reading"
    RESIDENT = "resident"
    WRITING = "writing"


@dataclass(slots=True, eq=False)  # entries are compared by identity (list membership), never by value
class _Entry:
    key: Hashable
    tensor: Tensor
    nbytes: int
    state: Residency = Residency.RESIDENT
    users: int = 0
    version: int = -1
    """The tensor's version when it was last read or written; -1: modified (never written)."""
    on_disk: bool = False
    """Whether the file holds the entry's current value."""
    future: Future[None] | None = field(default=None)
    copy: Copy | None = None
    """The device copy of the entry's last read from a ``HostStore`` until the host has waited for it (Note
    [stream-ordered reads])."""


def _check_owns_storage(key: Hashable, tensor: Tensor) -> int:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if tensor.storage_offset() != 0 or not tensor.is_contiguous() or storage.nbytes() not in (0, nbytes):
        raise ValueError(f"Tier entry {key} must be a contiguous tensor that owns its whole storage")
    return nbytes


class TensorSwapper:
    """Tensors kept in ``file`` (a ``TierStore``) between uses, with one background reader and one writer (Note
    [tier IO])."""

    def __init__(self, file: TierStore, io_entries: int) -> None:
        self.file = file
        self.io_entries = io_entries
        """Read-ahead and write-behind budgets, each in entries of the largest size: at most this many bytes are read
        ahead of use (Note [read-ahead order]) and waiting to be written (a release beyond it waits for the oldest
        write)."""
        self._largest = 0
        self._entries: dict[Hashable, _Entry] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tier-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tier-write")
        self._writing: list[_Entry] = []
        self._prefetched: list[_Entry] = []
        self._order: list[tuple[Hashable, bool]] = []
        """The previous step's ``acquire`` calls: (key, whether its value was read)."""
        self._recording: list[tuple[Hashable, bool]] = []
        self._cursor = 0
        self._owners: dict[int, Hashable] = {}
        """Storage (``UntypedStorage._cdata``, stable across resizes) -> the key of the entry that owns it."""
        self._counter = threading.Lock()
        self._resident = 0
        self.peak_resident_nbytes = 0
        """The most bytes of entries resident at once since ``reset_peak()`` (the writer thread frees too)."""

    # -- registration ----------------------------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def tensor(self, key: Hashable) -> Tensor:
        return self._entries[key].tensor

    def add(self, key: Hashable, tensor: Tensor) -> None:
        """Register ``tensor`` under ``key``: resident and modified, or, with no memory (storage resized to zero), an
        entry without a value yet. A new tensor for a known key replaces the old one (a checkpoint load)."""
        nbytes = _check_owns_storage(key, tensor)
        old = self._entries.get(key)
        if old is not None:
            self._settle(old, host=True)
            assert old.users == 0, f"tier entry {key} replaced while in use"
            if old.tensor is not tensor:
                self._free(old)
            if old in self._prefetched:
                self._prefetched.remove(old)
            self._owners.pop(_storage_id(old.tensor), None)
        self._largest = max(self._largest, nbytes)
        state = Residency.RESIDENT if tensor.untyped_storage().nbytes() else Residency.ON_DISK
        if state is Residency.RESIDENT and (old is None or old.tensor is not tensor):
            self._count(nbytes)
        self._entries[key] = _Entry(key, tensor, nbytes, state)
        self._owners[_storage_id(tensor)] = key

    def owner(self, tensor: Tensor) -> Hashable | None:
        """The key of the entry whose storage ``tensor`` (or a view of it) is, or None."""
        return self._owners.get(_storage_id(tensor))

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    # -- use ----------------------------------------------------------------------------------------------------------
    def acquire(self, key: Hashable, read: bool = True, in_order: bool = True) -> Tensor:
        """Make ``key`` resident and count a user. ``read=False``: its old value is not wanted (it is about to be
        overwritten), so nothing is read. ``in_order=False``: a use outside the step's order (an EMA update), which
        neither reads ahead nor becomes part of the next step's prediction (Note [read-ahead order])."""
        entry = self._entries[key]
        if in_order:
            self._recording.append((key, read))
        self._settle(entry)
        if entry.state is Residency.ON_DISK:
            self._allocate(entry)
            if read and entry.on_disk:
                finish = self.file.start_read(key, entry.tensor)
                if isinstance(finish, Copy):  # Note [stream-ordered reads]
                    entry.copy = finish
                    finish.order_compute()
                else:
                    finish()
            entry.state = Residency.RESIDENT
            entry.version = entry.tensor._version if read else -1
        if entry in self._prefetched:
            self._prefetched.remove(entry)
        entry.users += 1
        if in_order:
            self._read_ahead((key, read))
        return entry.tensor

    def release(self, key: Hashable, write: bool | None = None) -> None:
        """Drop a user; the last one writes the entry back (if modified, or as ``write`` says) and frees it."""
        entry = self._entries[key]
        assert entry.users > 0, f"tier entry {key} released more often than acquired"
        entry.users -= 1
        if entry.users == 0:
            self._evict(entry, write)

    def evict_all(self) -> None:
        """Write back and free every entry without a user (after a checkpoint load, at the end of setup)."""
        for entry in self._entries.values():
            self._settle(entry)
            if entry.users == 0 and entry.state is Residency.RESIDENT:
                self._evict(entry, None)

    def end_step(self) -> None:
        """The step's uses are over: its order predicts the next step's; unused read-ahead is dropped."""
        if self._recording:
            self._order, self._recording, self._cursor = self._recording, [], 0
        for entry in list(self._prefetched):
            self._settle(entry)
            self._free(entry)
            entry.state = Residency.ON_DISK
        self._prefetched.clear()

    def flush(self) -> None:
        """Wait for every background read and write; raise the first IO error."""
        for entry in self._entries.values():
            self._settle(entry, host=True)

    # -- ranged access (checkpoints): Note [ranged tier access] ----------------------------------------------------
    def read_range(self, key: Hashable, start: int, out: Tensor) -> None:
        """Fill ``out`` with the entry's bytes from byte ``start``, without making the entry resident. An entry that
        never had a value reads as zeros."""
        entry = self._entries[key]
        self._settle(entry)
        if entry.state is Residency.RESIDENT:
            out.copy_(_byte_range(entry.tensor, start, out))
        elif entry.on_disk:
            self.file.read_range(key, start, out)
        else:
            out.zero_()

    def write_range(self, key: Hashable, start: int, values: Tensor) -> None:
        """Write ``values`` over the entry's bytes from byte ``start``, in its memory if it is resident (and in use),
        else straight into its region of the file."""
        entry = self._entries[key]
        self._settle(entry, host=True)  # a read's copy may still be reading the bytes written here
        if entry.state is Residency.RESIDENT and entry in self._prefetched:  # a clean copy of what is in the file
            self._prefetched.remove(entry)
            self._free(entry)
            entry.state = Residency.ON_DISK
        if entry.state is Residency.RESIDENT:
            _byte_range(entry.tensor, start, values).copy_(values)  # dirty now: written back when released
            return
        self.file.write_range(key, entry.nbytes, start, values.contiguous())
        entry.on_disk = True

    def reset_peak(self) -> None:
        with self._counter:
            self.peak_resident_nbytes = self._resident

    @property
    def budget_bytes(self) -> int:
        """The read-ahead budget, and the write-behind one."""
        return self.io_entries * self._largest

    def resident_nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.state is not Residency.ON_DISK)

    def disk_nbytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        """Stop the IO threads (waiting for what is in flight, errors ignored: the files are removed next)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.file.close()

    # -- internals ----------------------------------------------------------------------------------------------------
    def _evict(self, entry: _Entry, write: bool | None) -> None:
        dirty = write if write is not None else (entry.version == -1 or entry.tensor._version != entry.version)
        if not dirty and entry.on_disk:
            self._free(entry)
            entry.state = Residency.ON_DISK
            return
        while self._writing and sum(e.nbytes for e in self._writing) + entry.nbytes > self.budget_bytes:
            self._settle(self._writing[0])
        entry.state = Residency.WRITING
        entry.future = self._writer.submit(self._write_and_free, entry, self.file.start_write(entry.key, entry.tensor))
        self._writing.append(entry)

    def _write_and_free(self, entry: _Entry, write: Callable[[], None]) -> None:
        write()
        entry.tensor.untyped_storage().resize_(0)
        self._count(-entry.nbytes)

    def _count(self, nbytes: int) -> None:
        with self._counter:
            self._resident += nbytes
            self.peak_resident_nbytes = max(self.peak_resident_nbytes, self._resident)

    def _settle(self, entry: _Entry, host: bool = False) -> None:
        """Finish the entry's background IO, if any; an IO error is raised here, in the training thread. A read by a
        device copy is finished by ordering the compute stream after it, and waited for on the host only with
        ``host`` (Note [stream-ordered reads])."""
        copy = entry.copy
        if copy is not None:
            if entry.state is Residency.READING:
                copy.order_compute()
                entry.state = Residency.RESIDENT
                entry.version = entry.tensor._version
            if host:
                copy.wait()
                entry.copy = None
        future = entry.future
        if future is None:
            return
        entry.future = None
        if entry.state is Residency.WRITING:
            self._writing.remove(entry)
            entry.state = Residency.ON_DISK
            future.result()
            entry.on_disk = True
        else:
            entry.state = Residency.RESIDENT
            future.result()
            entry.version = entry.tensor._version

    def _allocate(self, entry: _Entry) -> None:
        storage = entry.tensor.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(entry.nbytes)
            self._count(entry.nbytes)

    def _free(self, entry: _Entry) -> None:
        storage = entry.tensor.untyped_storage()
        if storage.nbytes():
            storage.resize_(0)
            self._count(-entry.nbytes)

    def _read_ahead(self, use: tuple[Hashable, bool]) -> None:
        order = self._order
        if not order or self.io_entries <= 0:
            return
        try:
            position = order.index(use, self._cursor)
        except ValueError:
            try:
                position = order.index(use)
            except ValueError:
                return
        self._cursor = position + 1
        budget = self.budget_bytes - sum(e.nbytes for e in self._prefetched)
        for upcoming, reads in order[position + 1 :]:
            if not reads:
                continue  # about to be overwritten (a gradient's first reduction): reading it would be wasted
            entry = self._entries.get(upcoming)
            if entry is None or entry.state is not Residency.ON_DISK or not entry.on_disk:
                if entry is not None and entry.state is Residency.WRITING:
                    break  # its write must land first; reading it now would read stale bytes
                continue
            if entry.nbytes > budget:
                break
            budget -= entry.nbytes
            self._allocate(entry)
            entry.state = Residency.READING
            finish = self.file.start_read(entry.key, entry.tensor)
            if isinstance(finish, Copy):  # ordered where it is used: Note [stream-ordered reads]
                entry.copy = finish
            else:
                entry.future = self._reader.submit(finish)
            self._prefetched.append(entry)


def _storage_id(tensor: Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _byte_range(tensor: Tensor, start: int, like: Tensor) -> Tensor:
    """``like.numel()`` elements of ``like``'s dtype at byte ``start`` of ``tensor``'s (resident) memory: a view."""
    nbytes = like.numel() * like.element_size()
    return tensor.reshape(-1).view(torch.uint8)[start : start + nbytes].view(like.dtype)
