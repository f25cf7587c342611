"""The writer process of asynchronous saves (Note [writer process] in ``async_save.py``), run as a script.

It imports torch and the standard library only, so that it starts in about the time ``import torch`` takes. It reads
pickled requests on stdin and answers each on stdout (anything else printed goes to stderr):

- ``("map", pid, fd, size, layout)``: map the staging memory, file descriptor ``fd`` of process ``pid``, and view
  each entry ``(key, offset, dtype, shape)`` of ``layout`` as a tensor over its own bytes;
- ``("write", files, sync)``: for each ``(path, records)`` of ``files``, write the file ``path`` record after record
  (``("staged", key)``: that staging tensor; ``("tensor", t)``: the tensor sent; ``("bytes", b)``: the bytes) as
  DCP's ``_write_item`` writes them for ``torch.save`` (the same bytes), ``fsync`` it if ``sync``, and answer each
  record's ``(offset, length)`` and the file's CRC-32.

Answers are ``("ok", value)`` or ``("error", message)``. It exits when asked (``("exit",)``: a forked data loader
worker may hold the pipe open) or at the end of its input, and is killed with the training process where ``prctl``
can ask for that.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import signal
import sys
import zlib
from typing import IO, Any, cast

import torch

_PR_SET_PDEATHSIG = 1


class _CountingFile:
    """What ``torch.save`` writes into: the file, with the position and CRC-32 of what went through."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.position = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        written = self._file.write(data)
        self.position += written
        return written

    def flush(self) -> None:
        self._file.flush()


def _map(pid: int, fd: int, size: int, layout: list[tuple[str, int, torch.dtype, torch.Size]]) -> dict[str, Any]:
    with open(f"/proc/{pid}/fd/{fd}", "r+b") as file:
        memory = mmap.mmap(file.fileno(), size)
    tensors: dict[str, Any] = {}
    for key, offset, dtype, shape in layout:
        nbytes = shape.numel() * dtype.itemsize
        # One storage per entry, exactly its bytes: torch.save writes a tensor's whole storage.
        flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0)
        tensors[key] = flat.view(dtype).view(shape)
    return tensors


def _write(staged: dict[str, Any], files: list[tuple[str, list[tuple[str, Any]]]], sync: bool) -> list[Any]:
    answers = []
    for path, records in files:
        spans = []
        with open(path, "wb") as raw:
            file = _CountingFile(raw)
            for kind, value in records:
                start = file.position
                if kind == "bytes":
                    file.write(value)
                else:
                    torch.save(staged[value] if kind == "staged" else value, cast(IO[bytes], file))
                spans.append((start, file.position - start))
            raw.flush()
            if sync:
                os.fsync(raw.fileno())
        answers.append((spans, file.crc))
    return answers


def main() -> None:
    if sys.platform == "linux":  # die with the training process rather than write on for nobody
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    staged: dict[str, Any] = {}
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        if request[0] == "exit":
            return
        try:
            if request[0] == "map":
                staged = _map(*request[1:])
                answer: tuple[str, Any] = ("ok", None)
            else:
                answer = ("ok", _write(staged, *request[1:]))
        except Exception as error:  # the training process raises it on every rank, through DCP
            answer = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    main()
