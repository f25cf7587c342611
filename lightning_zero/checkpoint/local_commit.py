"""The commit of a checkpoint directory on a local filesystem: at every instant its name holds a complete checkpoint.

Note [atomic commit]
On a local filesystem (remote URLs: Note [commit on an object store] in ``storage.py``), a save writes into a hidden
sibling ``.<name>.partial-<token>`` (never matched by Lightning's ``*.ckpt`` / ``last*`` lookups). Rank 0 writes
``lightning_state.pt`` only after DCP has finished every rank's files and ``.metadata`` (all fsynced), then commits:

- nothing under ``<name>`` yet: one rename;
- a checkpoint (or file, or link) under ``<name>``: swap the two atomically with ``renameat2(RENAME_EXCHANGE)`` and
  delete the old one afterwards.

Where the filesystem cannot exchange (NFS, Lustre, FUSE), two renames of directories would leave a moment with no
``<name>``. There ``<name>`` is a symbolic link instead: the save's directory becomes ``.<name>.data-<token>``, a new
link to it is made beside ``<name>`` and renamed over it (replacing a link or a file by a rename is atomic on every
POSIX filesystem), and only then is the old data deleted. The first save of a name checks whether its directory can
exchange (two empty probe directories) and, if not, commits as a link from the start. Lightning's lookups and our
loaders follow the link; ``remove_local`` renames the link away first, then deletes the data it named.

So at every instant ``<name>`` is either the old complete checkpoint or the new complete one, and a crash leaves at most
hidden leftovers (``.partial-``, ``.data-`` not linked, ``.link-``, ``.trash-``, ``.probe-``), removed by the next save
of the same name (``.trash-`` by the next save of any name). Removal renames before deleting, for the same reason (Note
[atomic removal]). One case is left: a filesystem that cannot exchange and finds a real directory already under
``<name>`` (made elsewhere, or copied there), or that has no links either. There the old checkpoint is renamed to
``.<name>.previous-<token>`` and the new one to ``<name>``, so that a crash between the two renames leaves it under a
name that says what it is: ``recover_interrupted_commit`` renames it back when the checkpoint is loaded by its name
(``consolidate`` too) and when the next save of that name starts, and it is deleted only once ``<name>`` exists again (a
directory cannot become a link without such a moment, so every save of that name goes this way). Lightning resolves
``ckpt_path="last"`` before any strategy code runs, so in this one case a resume by ``"last"`` right after such a crash
does not see it: pass the path.

Note [atomic removal]
Removing a checkpoint (``ModelCheckpoint`` dropping one out of its top k) is one rename too: the directory, or the
link ``commit`` made, becomes ``.<name>.trash-<token>`` and only then is deleted, a trashed link after the data it
names. So ``<name>`` is the whole checkpoint or nothing, and a process killed while deleting leaves only ``.trash-``
entries. Those are taken for what they are by the next save of *any* checkpoint in that directory, not only of the
same name (``epoch=N-step=M.ckpt`` names never come back): every save deletes them first (``remove_trash``). Other
leftovers stay tied to their own name, because a ``.partial-`` or unlinked ``.data-`` of another name may be a save
still in progress.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import uuid
from pathlib import Path

import torch


def partial_sibling(path: Path) -> Path:
    return _sibling(path, "partial")


def _sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:12]}")


def write_synced(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def commit(staged: Path, final: Path) -> None:
    """Make the complete directory ``staged`` appear as ``final`` in one step, replacing what was there."""
    _fsync_directory(staged)
    previous: Path | None = None
    old_data = _linked_data(final)  # replaced by a link or not, the data of a link we made goes with it
    if not os.path.lexists(final):
        if _can_exchange(final) or not _can_link(final):
            os.rename(staged, final)
        else:
            _link(staged, final)
    elif _exchange(staged, final):
        previous = staged  # the exchange left the old checkpoint (or file, or link) where the new one was
    elif (final.is_symlink() or not final.is_dir()) and _can_link(final):
        _link(staged, final)
    else:
        # A real directory that cannot be exchanged: Note [atomic commit], its last case.
        previous = _sibling(final, "previous")
        os.rename(final, previous)
        os.rename(staged, final)
    _fsync_directory(final.parent)
    for old in (previous, old_data):
        if old is not None:
            _delete(old)


def _link(staged: Path, final: Path) -> None:
    """Commit ``staged`` as ``final``, a link to it (Note [atomic commit])."""
    data = _sibling(final, "data")
    os.rename(staged, data)
    link = _sibling(final, "link")
    os.symlink(data.name, link)
    os.rename(link, final)  # the commit: final was the old checkpoint until here, the new one from here


def _linked_data(path: Path) -> Path | None:
    """The ``.<name>.data-<token>`` directory that the link ``path`` names, or None."""
    if not path.is_symlink():
        return None
    target = os.readlink(path)
    ours = target == os.path.basename(target) and target.startswith(f".{path.name}.data-")
    return path.with_name(target) if ours else None


def remove_stale_siblings(path: Path) -> None:
    """Delete what interrupted saves and removals of ``path`` left behind, after putting back a checkpoint that an
    interrupted commit left under its previous name (Note [atomic commit])."""
    recover_interrupted_commit(path)
    remove_trash(path.parent)  # of every checkpoint there: Note [atomic removal]
    linked = _linked_data(path)
    for kind in ("partial", "previous", "link", "data", "probe"):
        for stale in path.parent.glob(f".{path.name}.{kind}-*"):
            if stale != linked:
                _delete(stale, missing_ok=True)


def recover_interrupted_commit(path: Path) -> bool:
    """If a crash between the two renames of a commit left no ``path`` but its previous checkpoint beside it, rename
    that back to ``path`` (Note [atomic commit]). True if it did. Safe to call from several processes at once."""
    if os.path.lexists(path):
        return False
    previous = sorted(path.parent.glob(f".{path.name}.previous-*"), key=lambda p: p.lstat().st_mtime)
    if not previous:
        return False
    try:
        os.rename(previous[-1], path)
    except OSError:
        return False  # another process put it back first
    _fsync_directory(path.parent)
    return True


def recover_interrupted_commits(directory: Path) -> list[Path]:
    """``recover_interrupted_commit`` for every checkpoint of ``directory``; the checkpoints put back."""
    names = {p.name.rsplit(".previous-", 1)[0][1:] for p in directory.glob(".*.previous-*")}
    return [directory / name for name in sorted(names) if recover_interrupted_commit(directory / name)]


def remove_local(path: Path) -> None:
    """Remove a checkpoint file, directory or link in one step, then delete what it held (Note [atomic removal])."""
    if path.is_file() and not path.is_symlink():
        path.unlink()
        return
    if not os.path.lexists(path):
        return
    trash = _sibling(path, "trash")
    os.rename(path, trash)  # the removal: a directory, or a link with the data it names, is trash from here on
    _delete_trash(trash)


_TRASH = re.compile(r"\..+\.trash-[0-9a-f]{12}")
_DATA = re.compile(r"\..+\.data-[0-9a-f]{12}")


def remove_trash(directory: Path) -> None:
    """Delete what interrupted removals of any checkpoint of ``directory`` left (Note [atomic removal])."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if _TRASH.fullmatch(entry.name):
                _delete_trash(directory / entry.name)


def _delete_trash(trash: Path) -> None:
    """Delete a removed checkpoint: the data a trashed link names first, then the link; or the directory."""
    if trash.is_symlink():
        target = os.readlink(trash)
        if target == os.path.basename(target) and _DATA.fullmatch(target):  # a link ``commit`` made
            _delete(trash.with_name(target), missing_ok=True)
    _delete(trash, missing_ok=True)


def _delete(path: Path, missing_ok: bool = False) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        if not missing_ok:
            raise


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    # Nonzero (EINVAL, ENOSYS): the filesystem cannot exchange; the caller commits through a link.
    return bool(renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0)


def _can_exchange(beside: Path) -> bool:
    """Whether the filesystem of ``beside``'s directory can exchange two directories (tried on two empty ones)."""
    probes = [_sibling(beside, "probe"), _sibling(beside, "probe")]
    try:
        for probe in probes:
            probe.mkdir()
        return _exchange(*probes)
    finally:
        for probe in probes:
            with contextlib.suppress(OSError):
                probe.rmdir()


def _can_link(beside: Path) -> bool:
    """Whether the filesystem of ``beside``'s directory has symbolic links (some FUSE mounts do not)."""
    probe = _sibling(beside, "probe")
    try:
        os.symlink(probe.name, probe)
    except OSError:
        return False
    probe.unlink()
    return True


def _fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot open or sync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
