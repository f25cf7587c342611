"""Stateless collectives over flat buffers.

Every function takes the process group explicitly, launches asynchronously and returns a ``PendingCollective``:
the work handle, the buffers that must stay alive until it completes, any local post-processing, and the bytes this
rank sends. Callers record those bytes in a ``CommLedger`` (``ledger.py``).

Note [reduce-scatter on gloo]
Measured on the 2-core CPU machine, 2 ranks, one thread each (``benchmarks/collectives.py``): averaging a 4M-element
fp32 bucket took 21 ms with ``reduce_scatter_single``, 17 ms with ``all_reduce`` (which also moves twice the bytes)
and 15 ms with ``all_to_all_single`` followed by a local sum over the received chunks (85 ms vs 146 ms at 25M).
The all-to-all form moves exactly the bandwidth-optimal (N-1)/N of the input, so on gloo we use it; on every other
backend (NCCL) the native ``reduce_scatter_single`` is both fastest and optimal. The receive buffer is the caller's
(``scratch``, from its ``BufferPool``): allocated per call it cost ~5 ms of page faults per 16 MB bucket.

Note [all-gather on gloo]
Gloo's ``all_gather_single`` gathers into a temporary and then copies it into the output: 15.8 ms per 4M-element
fp32 bucket against 6.9 ms for N in-place broadcasts, one rooted at each rank, over the shard views of the output
(``benchmarks/collectives.py``, 2 ranks). Each rank sends its shard to the N-1 others and receives theirs: the same
(N-1)·shard bytes as a ring all-gather, with no temporary and no copy. NCCL's all-gather is in place already.

Note [when to average]
Gradients are averaged, not summed. Dividing the summed 1/N shard by N after the reduction is N times less work
than dividing the whole bucket before it, and for fp32 and bf16 (fp32's exponent range) the sum of N gradients
cannot overflow where the average would not. fp16 can (max 65504): fp16 buckets are divided before, as DDP does.
With N a power of two both orders give bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    works: tuple[dist.Work, ...]
    """The asynchronous operations it was issued as (none for a world of one, several for a broadcast gather)."""
    buffers: tuple[Tensor, ...]
    """Tensors the collective reads or writes; held so they outlive the asynchronous work."""
    bytes_sent: int
    """Bytes this rank puts on the wire with a bandwidth-optimal algorithm."""
    finish: Callable[[], None] | None = None
    """Local work to run once the data has arrived (the sum of the all-to-all reduce-scatter, the average)."""

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = ()
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.buffers = ()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _runs_on_gloo(tensor: Tensor, group: ProcessGroup) -> bool:
    backend = str(dist.get_backend(group))
    if ":" not in backend:  # a single backend for every device, e.g. "gloo" or "nccl"
        return backend == "gloo"
    # A per-device mapping such as "cpu:gloo,cuda:nccl".
    per_device = dict(entry.split(":") for entry in backend.split(","))
    return per_device.get(tensor.device.type) == "gloo"


def reduce_scatter(
    output: Tensor, input: Tensor, group: ProcessGroup, *, scratch: Tensor | None = None
) -> PendingCollective:
    """Average ``input`` (world * shard elements) across ranks; this rank's shard lands in ``output``.

    ``input`` must not change until the collective completes; fp16 input is divided by the world size in place
    first (Note [when to average]). ``scratch``: on gloo, a buffer of ``input``'s size and dtype to receive into,
    lent by the caller until ``wait()`` returns; without it one is allocated. ``output`` may be this rank's own
    chunk of ``input`` (an in-place reduce-scatter): gloo writes it only once the exchange is complete.
    """
    world = group.size()
    assert input.numel() == output.numel() * world, (input.shape, output.shape, world)
    if world == 1:
        output.copy_(input)
        return PendingCollective(Collective.REDUCE_SCATTER, (), (), 0)
    divide_first = input.dtype == torch.float16  # Note [when to average]
    if divide_first:
        input.div_(world)
    bytes_sent = _nbytes(input) * (world - 1) // world
    if _runs_on_gloo(input, group):
        # See Note [reduce-scatter on gloo].
        if scratch is None:
            scratch = torch.empty_like(input)
        assert scratch.numel() == input.numel(), (scratch.shape, input.shape)
        assert scratch.dtype == input.dtype, (scratch.dtype, input.dtype)
        received = scratch.view(input.shape)  # chunk r is rank r's contribution to our shard
        work = dist.all_to_all_single(received, input, group=group, async_op=True)

        def finish() -> None:
            torch.sum(received.view(world, -1), dim=0, out=output.view(-1))
            if not divide_first:
                output.div_(world)

        return PendingCollective(Collective.REDUCE_SCATTER, (work,), (received, input, output), bytes_sent, finish)
    work = dist.reduce_scatter_single(output, input, group=group, async_op=True)

    def average() -> None:
        output.div_(world)

    return PendingCollective(
        Collective.REDUCE_SCATTER, (work,), (input, output), bytes_sent, None if divide_first else average
    )


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
        return PendingCollective(Collective.ALL_GATHER, (), (), 0)
    bytes_sent = _nbytes(input) * (world - 1)
    if _runs_on_gloo(output, group):
        # See Note [all-gather on gloo].
        shards = output.view(world, -1)
        own = shards[group.rank()]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input.view(-1))
        works = tuple(
            dist.broadcast(shards[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
            for r in range(world)
        )
        return PendingCollective(Collective.ALL_GATHER, works, (output, input), bytes_sent)
    work = dist.all_gather_single(output, input, group=group, async_op=True)
    return PendingCollective(Collective.ALL_GATHER, (work,), (output, input), bytes_sent)


def all_reduce_sum(tensor: Tensor, group: ProcessGroup) -> PendingCollective:
    """Sum ``tensor`` in place across ranks (small tensors: norms, overflow flags)."""
    world = group.size()
    if world == 1:
        return PendingCollective(Collective.ALL_REDUCE, (), (), 0)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingCollective(Collective.ALL_REDUCE, (work,), (tensor,), 2 * _nbytes(tensor) * (world - 1) // world)
