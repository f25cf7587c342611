"""``SwapFile``: one rank's tier file, cut into regions, read and written straight into tensor memory.

Note [tier IO]
A shard moves between its file and a tensor with ``os.preadv``/``os.pwritev`` straight into the tensor's own memory
rather than by copying from/to an ``np.memmap`` of the file: the call copies once (kernel to tensor) and releases the
GIL for its whole length, so a background thread overlaps it with compute, while a memmap copy runs in the calling
thread, faults page by page and leaves dirty pages for the kernel to write back when it likes (neither the timing nor
the page cache charged to the job is then under our control). Each rank has one reader and one writer thread; calls
move at most ``_IO_CHUNK`` bytes (Linux moves at most ~2 GiB per call). The pages stay in the kernel's page cache,
which is not part of any process's resident memory and is reclaimed under pressure: a shard read again soon (a
unit's parameters in backward after forward, a gradient written in backward and read by the step) may then come
from memory instead of the disk. Dropping written pages right away (``posix_fadvise(DONTNEED)``) was measured to
make the writer wait for the disk (32 MiB regions on this machine: 0.33 GB/s instead of 1.1 GB/s).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from torch import Tensor

_IO_CHUNK = 1 << 30


class TierIOError(OSError):
    """A tier file could not be read or written; the message names the file and what was being moved."""


def _bytes_of(tensor: Tensor) -> memoryview:
    """The tensor's memory as a writable byte buffer (no copy): what ``preadv``/``pwritev`` fill or drain. Built from
    the data pointer, not ``Tensor.numpy()``, which would pin the storage's size (it must stay resizable)."""
    assert tensor.device.type == "cpu", "tier IO moves host memory"
    assert tensor.is_contiguous(), "tier IO moves contiguous tensors"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _buffer(data: memoryview, start: int) -> memoryview:
    """At most ``_IO_CHUNK`` bytes of ``data`` from ``start``."""
    return data[start : start + _IO_CHUNK]


class SwapFile:
    """A file of named regions. ``region(key, nbytes)`` places a key once (append-only); ``read``/``write`` move
    one region from/to a contiguous CPU tensor and count the bytes moved."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # O_EXCL: a file that exists belongs to someone else (two jobs sharing offload_dir never share files).
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._regions: dict[object, tuple[int, int]] = {}
        self._end = 0
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0

    def region(self, key: object, nbytes: int) -> tuple[int, int]:
        """(offset, nbytes) of ``key``'s region, placed at the end of the file on first use."""
        with self._lock:
            placed = self._regions.get(key)
            if placed is None or placed[1] < nbytes:
                placed = (self._end, nbytes)
                self._regions[key] = placed
                self._end += -(-nbytes // 4096) * 4096  # page-aligned regions
            return placed

    @property
    def nbytes(self) -> int:
        """Bytes the file takes: every region placed so far."""
        return self._end

    def write(self, key: object, tensor: Tensor) -> None:
        self.write_range(key, tensor.numel() * tensor.element_size(), 0, tensor)

    def read(self, key: object, tensor: Tensor) -> None:
        self.read_range(key, 0, tensor)

    def start_write(self, key: object, tensor: Tensor) -> Callable[[], None]:
        """The write, to run on a background thread (``TierStore``): file IO has nothing to start here."""
        return partial(self.write, key, tensor)

    def start_read(self, key: object, tensor: Tensor) -> Callable[[], None]:
        return partial(self.read, key, tensor)

    def write_range(self, key: object, nbytes: int, start: int, tensor: Tensor) -> None:
        """Write ``tensor`` at byte ``start`` of ``key``'s region of ``nbytes`` (placed now if it is new)."""
        offset, _ = self.region(key, nbytes)
        data = _bytes_of(tensor)
        done = 0
        try:
            while done < data.nbytes:
                done += os.pwritev(self._fd, [_buffer(data, done)], offset + start + done)
        except OSError as error:
            what = "the disk is full" if error.errno == errno.ENOSPC else os.strerror(error.errno or 0)
            raise TierIOError(
                error.errno,
                f"Writing {data.nbytes:,} bytes of {key} to the tier file {self.path} failed: {what}. The file already "
                f"holds {self._end:,} bytes. HINT: free space on that disk or point offload_dir elsewhere.",
            ) from error
        with self._lock:
            self.bytes_written += data.nbytes

    def read_range(self, key: object, start: int, tensor: Tensor) -> None:
        """Fill ``tensor`` from byte ``start`` of ``key``'s region."""
        placed = self._regions.get(key)
        assert placed is not None, f"{key} was never written to {self.path}"
        data = _bytes_of(tensor)
        done = 0
        while done < data.nbytes:
            got = os.preadv(self._fd, [_buffer(data, done)], placed[0] + start + done)
            if got == 0:
                raise TierIOError(
                    errno.EIO, f"The tier file {self.path} ended before {key}'s {data.nbytes:,} bytes could be read."
                )
            done += got
        with self._lock:
            self.bytes_read += data.nbytes

    def sync(self) -> None:
        """Wait until everything written is on the disk."""
        os.fsync(self._fd)

    def drop_cache(self) -> None:
        """Drop the file's clean pages from the page cache (after ``sync``: the next reads come from the disk)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
