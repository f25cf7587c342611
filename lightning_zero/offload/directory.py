"""``OffloadDirectory``: where one rank's tier files live, checked before anything is written and always removed.

Note [tier directories]
``ZeroConfig.offload_dir`` may be shared by many jobs (a scratch disk). Each rank of each job creates its own
sub-directory with ``mkdtemp`` (a fresh, unique name created atomically, mode 0700) and its tier file inside it with
``O_EXCL``, so two jobs given the same ``offload_dir`` never open each other's files, and a job never reuses files
left by a crashed one. The sub-directory is removed when the strategy tears down, when the job fails
(``on_exception``) and, as a last resort, at interpreter exit; a process killed with SIGKILL leaves it behind, named
``lightning_zero-<host>-<pid>-rank<r>-*`` so that it can be traced to its job.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from pathlib import Path


class OffloadDirectoryError(ValueError):
    """``offload_dir`` cannot hold the tiers: missing, not writable, or too small."""


def resolve_offload_dir(offload_dir: str, root_dir: str | os.PathLike[str]) -> Path:
    """An absolute ``offload_dir`` must exist and be writable; a relative one is created under ``root_dir``."""
    path = Path(offload_dir)
    if not path.is_absolute():
        path = Path(root_dir) / path
        path.mkdir(parents=True, exist_ok=True)
    if not path.is_dir():
        raise OffloadDirectoryError(
            f"Invalid ZeroConfig.offload_dir: {offload_dir!r}. {path} does not exist or is not a directory. HINT: "
            "create it first, or give a path relative to the Trainer's default_root_dir, which is created."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadDirectoryError(
            f"Invalid ZeroConfig.offload_dir: {offload_dir!r}. {path} is not writable by this process. HINT: "
            "choose a directory you can write to."
        )
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem of ``path``."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def check_free_space(path: Path, per_rank: int, ranks: int, what: str) -> None:
    """Refuse to start when the disk under ``path`` has less free space than ``ranks`` ranks (those of this machine,
    which share it) need at ``per_rank`` bytes each."""
    needed = per_rank * ranks
    free = free_bytes(path)
    if needed > free:
        raise OffloadDirectoryError(
            f"Not enough free space for the disk tier in {path}: {what} needs {needed:,} bytes ({needed / 1e9:.2f} GB: "
            f"{per_rank:,} per rank x {ranks} rank(s) on this machine), and the disk has {free:,} bytes "
            f"({free / 1e9:.2f} GB) free. HINT: free space, point offload_dir at a larger disk, lower offload_ratio, "
            "or use more machines."
        )


class OffloadDirectory:
    """This rank's private sub-directory of ``offload_dir`` (Note [tier directories])."""

    def __init__(self, base: Path, rank: int) -> None:
        self.base = base
        prefix = f"lightning_zero-{socket.gethostname()}-{os.getpid()}-rank{rank}-"
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        atexit.register(self.remove)

    def file(self, name: str) -> Path:
        return self.path / name

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        atexit.unregister(self.remove)
