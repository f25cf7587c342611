"""Per-process memory measurement for tests: resident set size with glibc's caching turned down.

glibc keeps freed memory for reuse, so the RSS of a process that frees a large tensor does not drop and its peak
hides when memory was released. Lowering the mmap threshold makes every allocation of 64 KiB or more a separate
mapping that is returned to the kernel on free; ``/proc/self/clear_refs`` resets the kernel's peak (VmHWM), so the
peak of one phase (a training step) can be read on its own.
"""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from <malloc.h>


def return_freed_memory_to_the_kernel() -> None:
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: RSS measurements would include cached memory")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_bytes("VmRSS:")


def anonymous_bytes() -> int:
    """Resident memory that is not a file's pages: the heap, tensors, stacks (``RssAnon``)."""
    return _status_bytes("RssAnon:")


def file_bytes() -> int:
    """Resident pages of files: the code of the libraries as far as it ran (``RssFile``)."""
    return _status_bytes("RssFile:")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM:")
