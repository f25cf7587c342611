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


class NewStorageBytes:
    """The peak of the bytes held at once by tensor storages created inside the context, counted at every torch op
    (a ``TorchDispatchMode``): what a phase allocates on top of what existed before it, whatever the device.

    A storage is new when an op returns it and none of the op's inputs held it (views share their input's); it
    counts its current size (a storage resized to zero, as a released stage-3 unit is, counts zero) while it lives.
    """

    def __init__(self) -> None:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        self.peak = 0
        live: list[weakref.ref] = []

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):  # noqa: N805
                import torch
                from torch.utils._pytree import tree_leaves

                out = func(*args, **(kwargs or {}))
                held = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in held:
                        live.append(weakref.ref(t.untyped_storage()))
                live[:] = [ref for ref in live if ref() is not None]
                self.peak = max(self.peak, sum(ref().nbytes() for ref in live if ref() is not None))
                return out

        self._mode = _Count()

    def __enter__(self) -> NewStorageBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
