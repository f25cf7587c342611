"""Count host-device synchronizations: what ``.item()``, ``bool(tensor)``, ``.tolist()`` do on a device tensor.

``.item()`` and everything built on it (``bool``, ``float``, ``int``, ``if tensor:``) dispatch
``aten._local_scalar_dense``, which a ``TorchDispatchMode`` sees on any device, so a count taken on the CPU is the
count a GPU run would block on. ``.tolist()`` copies without dispatching that op, so it is counted by wrapping the
method for the duration. Use it around steady-state steps (after a warm-up step, whose one-off checks may read
values)::

    with count_host_syncs() as syncs:
        step()
    assert syncs.count == 0, syncs.where

Only the calling thread is observed (dispatch modes are thread-local; autograd's CPU backward runs on it).

Not counted: reads from inside ``torch.optim``. The user's optimizer keeps its ``step`` counters on the host (unless
``capturable``) precisely so that reading them, as Adam does every step, is not a synchronization on a GPU; on the
CPU the two cannot be told apart by device.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class HostSyncs:
    count: int = 0
    where: list[str] = field(default_factory=list)
    """The innermost frames of the caller of each sync, for the failure message."""

    def add(self, what: str) -> None:
        self.count += 1
        frames = [f for f in traceback.extract_stack()[:-3] if "host_syncs.py" not in f.filename][-3:]
        self.where.append(what + " at " + " <- ".join(f"{f.filename}:{f.lineno} {f.name}" for f in reversed(frames)))


_HOST_STATE_OWNERS = (os.path.join("torch", "optim", ""),)
"""Code whose scalar reads are of host tensors by design (see the module docstring)."""


def _from_host_state_owner() -> bool:
    return any(owner in frame.filename for frame in traceback.extract_stack() for owner in _HOST_STATE_OWNERS)


class _CountLocalScalarDense(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and not _from_host_state_owner():
            self.syncs.add("aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    syncs = HostSyncs()
    tolist = torch.Tensor.tolist

    def counted_tolist(self: torch.Tensor) -> Any:
        syncs.add("Tensor.tolist")
        return tolist(self)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign,assignment]
    try:
        with _CountLocalScalarDense(syncs):
            yield syncs
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
