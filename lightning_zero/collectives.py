"""Stateless collectives over flat buffers, and the ledger that counts what they move.

Every function takes the process group explicitly, launches asynchronously and returns a ``PendingCollective``:
the work handle, the buffers that must stay alive until it completes, any local post-processing, and the bytes this
rank sends. Callers record those bytes in a ``CommLedger``.

Note [reduce-scatter on gloo]
Measured on the 2-core CPU machine, 2 ranks, one thread each (``benchmarks/collectives.py``): averaging a 4M-element
fp32 bucket took 21 ms with ``reduce_scatter_single``, 17 ms with ``all_reduce`` (which also moves twice the bytes)
and 15 ms with ``all_to_all_single`` followed by a local sum over the received chunks (85 ms vs 146 ms at 25M).
The all-to-all form moves exactly the bandwidth-optimal (N-1)/N of the input, so on gloo we use it; on every other
backend (NCCL) the native ``reduce_scatter_single`` is both fastest and optimal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup


class Collective(str, Enum):
    """The collectives ZeRO issues, as recorded in the ledger."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_REDUCE = "all_reduce"


@dataclass
class PendingCollective:
    """An issued collective. ``wait()`` blocks until its result is in the output tensor."""

    kind: Collective
    work: dist.Work | None
    """None when nothing was sent (a world of one)."""
    buffers: tuple[Tensor, ...]
    """Tensors the collective reads or writes; held so they outlive the asynchronous work."""
    bytes_sent: int
    """Bytes this rank puts on the wire with a bandwidth-optimal algorithm."""
    finish: Callable[[], None] | None = None
    """Local work to run once the data has arrived (the sum of the all-to-all reduce-scatter)."""

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.buffers = ()


@dataclass
class CommLedger:
    """Bytes and calls per collective. ``current`` accumulates until ``end_step()`` moves it to ``last_step``,
    which therefore always holds exactly one optimizer step's communication; ``total`` keeps everything."""

    current: dict[Collective, int] = field(default_factory=dict)
    last_step: dict[Collective, int] = field(default_factory=dict)
    total: dict[Collective, int] = field(default_factory=dict)
    calls: dict[Collective, int] = field(default_factory=dict)
    steps: int = 0

    def record(self, pending: PendingCollective) -> PendingCollective:
        self.current[pending.kind] = self.current.get(pending.kind, 0) + pending.bytes_sent
        self.calls[pending.kind] = self.calls.get(pending.kind, 0) + 1
        return pending

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        for kind, nbytes in self.current.items():
            self.total[kind] = self.total.get(kind, 0) + nbytes
        self.current.clear()
        self.steps += 1

    def last_step_bytes(self) -> dict[str, int]:
        return {kind.value: nbytes for kind, nbytes in self.last_step.items()}


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _runs_on_gloo(tensor: Tensor, group: ProcessGroup) -> bool:
    backend = str(dist.get_backend(group))
    if ":" not in backend:  # a single backend for every device, e.g. "gloo" or "nccl"
        return backend == "gloo"
    # A per-device mapping such as "cpu:gloo,cuda:nccl".
    per_device = dict(entry.split(":") for entry in backend.split(","))
    return per_device.get(tensor.device.type) == "gloo"


def reduce_scatter(output: Tensor, input: Tensor, group: ProcessGroup) -> PendingCollective:
    """Average ``input`` (world * shard elements) across ranks; this rank's shard lands in ``output``.

    ``input`` is consumed: it is divided by the world size in place before communicating, as DDP does, so that
    low-precision sums cannot overflow. ``output`` may be a slice of ``input`` only on non-gloo backends.
    """
    world = group.size()
    assert input.numel() == output.numel() * world, (input.shape, output.shape, world)
    if world == 1:
        output.copy_(input)
        return PendingCollective(Collective.REDUCE_SCATTER, None, (), 0)
    input.div_(world)
    bytes_sent = _nbytes(input) * (world - 1) // world
    if _runs_on_gloo(input, group):
        # See Note [reduce-scatter on gloo].
        received = torch.empty_like(input)  # (world * shard,): chunk r is rank r's contribution to our shard
        work = dist.all_to_all_single(received, input, group=group, async_op=True)

        def finish() -> None:
            torch.sum(received.view(world, -1), dim=0, out=output.view(-1))

        return PendingCollective(Collective.REDUCE_SCATTER, work, (received, input, output), bytes_sent, finish)
    work = dist.reduce_scatter_single(output, input, group=group, async_op=True)
    return PendingCollective(Collective.REDUCE_SCATTER, work, (input, output), bytes_sent)


def all_gather(output: Tensor, input: Tensor, group: ProcessGroup) -> PendingCollective:
    """Gather every rank's ``input`` shard into ``output`` (world * shard elements), in rank order.

    ``input`` may be this rank's own slice of ``output`` (an in-place gather): the updated shard is written straight
    into the flat parameter buffer with no copy-out.
    """
    world = group.size()
    assert output.numel() == input.numel() * world, (output.shape, input.shape, world)
    if world == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return PendingCollective(Collective.ALL_GATHER, None, (), 0)
    work = dist.all_gather_single(output, input, group=group, async_op=True)
    return PendingCollective(Collective.ALL_GATHER, work, (output, input), _nbytes(input) * (world - 1))


def all_reduce_sum(tensor: Tensor, group: ProcessGroup) -> PendingCollective:
    """Sum ``tensor`` in place across ranks (small tensors: norms, overflow flags)."""
    world = group.size()
    if world == 1:
        return PendingCollective(Collective.ALL_REDUCE, None, (), 0)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingCollective(Collective.ALL_REDUCE, work, (tensor,), 2 * _nbytes(tensor) * (world - 1) // world)
