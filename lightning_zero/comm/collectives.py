"""Stateless collectives over flat buffers.

Every function takes the process group explicitly, launches asynchronously and returns a ``PendingCollective``
(``pending_collective.py``): the work handles, the buffers that must stay alive until it completes, any local
post-processing, and a ``Send`` per call into ``torch.distributed`` (what was handed to it, measured at the call).
Callers record them in a ``CommLedger`` (``ledger.py``). An optional ``CollectiveStream`` runs the collective on a
side stream of its device (Note [collective streams] in ``streams.py``).

Note [native collectives]
On NCCL (and any backend but gloo) a reduce-scatter is ``reduce_scatter_single`` and an all-gather
``all_gather_single`` (recent torch; older ones, down to the ``torch>=2.6`` we accept, have only the long-standing
``reduce_scatter_tensor`` / ``all_gather_into_tensor``, which recent torch deprecates: the newer name is looked up at
the call and the older one used without it). On gloo we take the faster
forms of the notes below. The environment variable ``LIGHTNING_ZERO_NATIVE_COLLECTIVES=1`` makes every collective
take the native branch on gloo too, so that CPU tests run the exact code path GPUs take (gloo implements both native
ops in fp32, fp16, bf16 and int64). It is an environment switch, not a ``ZeroConfig`` field, because it must reach
every collective, including those issued by code that never sees the config (the divergence check, the optimizer's
parameter gathers), and because the test harness hands the environment to every rank. It is read at each call.
Gloo's own forms are for host tensors only: gloo runs its collectives on CUDA tensors (through host copies), but
its point-to-point ``isend``/``irecv`` hands the CUDA pointer to the socket, and the rank aborts (``writev ... Bad
address``, SIGABRT; torch 2.11 on an H100, ``scripts/gpu_check.sh``). So a gloo group with CUDA tensors (ranks
sharing one GPU) takes the native branch whatever the environment says.

Note [reduce-scatter on gloo]
Measured on the 2-core CPU machine, 2 ranks, one thread each (``benchmarks/collectives.py``): averaging a 4M-element
fp32 bucket took 21 ms with ``reduce_scatter_single``, 17 ms with ``all_reduce`` (which also moves twice the bytes) and
15 ms with ``all_to_all_single`` followed by a local sum over the received chunks (85 ms vs 146 ms at 25M). The
all-to-all needs a receive buffer as large as the bucket, though, of which one chunk is a copy of our own. So on gloo a
reduce-scatter is a pairwise exchange instead: to each peer, ``isend`` the chunk it owns and ``irecv`` its chunk of
ours. The first peer's chunk lands straight in ``output`` and only the others (N-2 chunks) in the caller's ``scratch``
(``receive_buffer_numel``; none at N = 2), then ours is added in place: the same (N-1)/N of the input on the wire, no
copy of our own chunk, and no receive buffer at all on two ranks. It is also faster, local sum included: 7.5 against
10.4 ms at 4M elements and 42.0 against 64.7 ms at 25M (2 ranks, same run). The chunks are summed in rank order, c0 + c1
+ ..., as the all-to-all's sum over its rows did, then divided by N. When ``output`` is our own chunk of ``input``
(stage 1's in-place reduction) it cannot receive: N-1 chunks go to ``scratch``. On every other backend (NCCL) the native
``reduce_scatter_single`` is both fastest and optimal and needs no buffer.

Note [all-gather on gloo]
Gloo's ``all_gather_single`` gathers into a temporary and then copies it into the output: 15.8 ms per 4M-element fp32
bucket against 6.9 ms for N in-place broadcasts, one rooted at each rank, over the shard views of the output
(``benchmarks/collectives.py``, 2 ranks). The pairwise form the reduce-scatter uses (``isend`` our shard to each peer,
``irecv`` theirs into their views of the output) costs the same within the noise (5.6 against 5.4 ms at 4M elements and
36.0 against 37.0 ms at 25M in one run, 4.3 against 5.9 and 30.2 against 35.4 in another) and keeps one form, and one
set of tags, for both. Each rank sends its shard to the N-1 others and receives theirs: the same (N-1)·shard bytes as a
ring all-gather, with no temporary and no copy. NCCL's all-gather is in place already.

Note [pairwise tags]
Point-to-point messages between two ranks are matched by tag, in the order they were posted. Reduce-scatters and
all-gathers each have a tag of their own, so that a message of one kind can never complete a receive of the other;
within a kind, every rank issues the collectives of a group in the same order (what pairs any collective), and that
order pairs the messages.

Note [when to average]
Gradients are averaged, not summed. Dividing the summed 1/N shard by N after the reduction is N times less work
than dividing the whole bucket before it, and for fp32 and bf16 (fp32's exponent range) the sum of N gradients
cannot overflow where the average would not. fp16 can (max 65504): fp16 buckets are divided before, as DDP does.
With N a power of two both orders give bit-identical results.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.pending_collective import Collective, PendingCollective, Send, make_send, nbytes
from lightning_zero.comm.streams import CollectiveStream

ProcessGroup = dist.ProcessGroup

NATIVE_COLLECTIVES_ENV = "LIGHTNING_ZERO_NATIVE_COLLECTIVES"
"""Set to ``1`` to run the native (NCCL) branch of every collective on gloo too: Note [native collectives]."""
REDUCE_SCATTER_TAG = 0x5253
"""Tag of gloo's pairwise reduce-scatter messages (Note [pairwise tags])."""
ALL_GATHER_TAG = 0x4147
"""Tag of gloo's pairwise all-gather messages (Note [pairwise tags])."""


class ReduceScatterOptions(TypedDict, total=False):
    """``reduce_scatter``'s keyword arguments, which a drop-in for it takes too (ZeRO++'s
    ``HierarchicalReduceScatter``, ``hierarchical_reduce.py``)."""

    scratch: Tensor | None
    stream: CollectiveStream | None


def native_collectives() -> bool:
    """Whether ``LIGHTNING_ZERO_NATIVE_COLLECTIVES`` asks for the native branch on gloo (Note [native collectives])."""
    value = os.environ.get(NATIVE_COLLECTIVES_ENV, "")
    if value in ("", "0", "false", "False"):
        return False
    if value in ("1", "true", "True"):
        return True
    raise ValueError(
        f"Invalid environment variable {NATIVE_COLLECTIVES_ENV}={value!r}. Expected 1 (native collectives on "
        f"gloo too) or 0 (gloo's faster forms). HINT: `export {NATIVE_COLLECTIVES_ENV}=1`, or unset it."
    )


def _host_tensors_on_gloo(device: torch.device, group: ProcessGroup) -> bool:
    """Whether ``device``'s tensors go through gloo over ``group`` *and* may take gloo's pairwise forms: host
    tensors only (Note [native collectives])."""
    if device.type != "cpu":
        return False
    backend = str(dist.get_backend(group))
    if ":" not in backend:  # a single backend for every device, e.g. "gloo" or "nccl"
        return backend == "gloo"
    # A per-device mapping such as "cpu:gloo,cuda:nccl".
    per_device = dict(entry.split(":") for entry in backend.split(","))
    return per_device.get(device.type) == "gloo"


def _gloo_form(tensor: Tensor, group: ProcessGroup) -> bool:
    """Whether this collective takes gloo's own form (Notes [reduce-scatter on gloo], [all-gather on gloo])."""
    return _host_tensors_on_gloo(tensor.device, group) and not native_collectives()


def takes_pieces(device: torch.device, group: ProcessGroup) -> bool:
    """Whether a reduce-scatter on ``device`` over ``group`` takes gloo's pairwise form, which ``reduce_scatter_pieces``
    needs (Note [reduce-scatter on gloo])."""
    return group.size() > 1 and _host_tensors_on_gloo(device, group) and not native_collectives()


def _received_apart(world: int, in_place: bool) -> int:
    """Chunks of the pairwise reduce-scatter that land in ``scratch``: every peer's but the first, which lands in the
    output, unless the output is our own chunk of the input (Note [reduce-scatter on gloo])."""
    return world - 1 - (0 if in_place else 1)


def receive_buffer_sizes(shard_numel: int, device: torch.device, group: ProcessGroup) -> tuple[int, ...]:
    """Every ``receive_buffer_numel`` a reduce-scatter of ``shard_numel``-element shards may ask for on ``device``:
    out of place and in place. A pool reserves them ahead (Note [size classes] in ``buffer_pool.py``)."""
    if not takes_pieces(device, group):
        return ()
    sizes = (_received_apart(group.size(), in_place) * shard_numel for in_place in (False, True))
    return tuple(n for n in sizes if n > 0)


def receive_buffer_numel(output: Tensor, input: Tensor, group: ProcessGroup) -> int:
    """Elements of the ``scratch`` receive buffer ``reduce_scatter(output, input, group)`` needs: in gloo's pairwise
    form, the chunks of the peers that cannot land in ``output`` (Note [reduce-scatter on gloo]); 0 on NCCL."""
    if not takes_pieces(input.device, group):
        return 0
    return _received_apart(group.size(), _aliases(output, input)) * output.numel()


def _aliases(a: Tensor, b: Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _native(new: str, old: str) -> Callable[..., Any]:
    function: Callable[..., Any] | None = getattr(dist, new, None)
    return function if function is not None else getattr(dist, old)  # Note [native collectives]


def reduce_scatter(
    output: Tensor,
    input: Tensor,
    group: ProcessGroup,
    *,
    scratch: Tensor | None = None,
    stream: CollectiveStream | None = None,
) -> PendingCollective:
    """Average ``input`` (world * shard elements) across ranks; this rank's shard lands in ``output``.

    ``input`` must not change until the collective completes; fp16 input is divided by the world size in place
    first (Note [when to average]). ``scratch``: in gloo's form, a buffer of ``receive_buffer_numel`` elements of
    ``input``'s dtype to receive into, lent by the caller until ``wait()`` returns; without it one is allocated.
    ``output`` may be this rank's own chunk of ``input`` (an in-place reduce-scatter): gloo writes it only once the
    exchange is complete, NCCL supports that aliasing.
    """
    world = group.size()
    assert input.numel() == output.numel() * world, (input.shape, output.shape, world)
    if world == 1:
        output.copy_(input)
        return PendingCollective(Collective.REDUCE_SCATTER, (), ())
    divide_first = input.dtype == torch.float16  # Note [when to average]
    if divide_first:
        input.div_(world)
    wire_bytes = nbytes(input) * (world - 1) // world
    if _gloo_form(input, group):
        chunks = [[chunk] for chunk in input.view(world, -1)]
        return _pairwise_reduce_scatter(output, chunks, group, scratch, stream, divide_first, (input,))
    function = _native("reduce_scatter_single", "reduce_scatter_tensor")
    with stream.launch() if stream is not None else nullcontext():
        work = function(output, input, group=group, async_op=True)

    def average() -> None:
        output.div_(world)

    return PendingCollective(
        Collective.REDUCE_SCATTER,
        (work,),
        (input, output),
        (make_send(function, input, wire_bytes, group),),
        None if divide_first else average,
        stream,
    )


def all_gather(
    output: Tensor, input: Tensor, group: ProcessGroup, *, stream: CollectiveStream | None = None
) -> PendingCollective:
    """Gather every rank's ``input`` shard into ``output`` (world * shard elements), in rank order.

    ``input`` may be this rank's own slice of ``output`` (an in-place gather): the updated shard is written straight
    into the flat parameter buffer with no copy-out.
    """
    world = group.size()
    assert output.numel() == input.numel() * world, (output.shape, input.shape, world)
    if world == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return PendingCollective(Collective.ALL_GATHER, (), ())
    if _gloo_form(output, group):
        # See Note [all-gather on gloo].
        shards = output.view(world, -1)
        rank = group.rank()
        own = shards[rank]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input.view(-1))
        exchange = [(r, [own], [shards[r]]) for r in range(world) if r != rank]
        return _exchange(Collective.ALL_GATHER, exchange, group, ALL_GATHER_TAG, (output, input), None, stream)
    function = _native("all_gather_single", "all_gather_into_tensor")
    with stream.launch() if stream is not None else nullcontext():
        work = function(output, input, group=group, async_op=True)
    send = make_send(function, input, nbytes(input) * (world - 1), group)
    return PendingCollective(Collective.ALL_GATHER, (work,), (output, input), (send,), None, stream)


def reduce_scatter_pieces(
    output: Tensor,
    chunks: Sequence[Sequence[Tensor]],
    group: ProcessGroup,
    *,
    scratch: Tensor | None = None,
    stream: CollectiveStream | None = None,
) -> PendingCollective:
    """``reduce_scatter`` of an input that exists only in pieces: ``chunks[r]`` lists the contiguous tensors whose
    concatenation is rank r's chunk of this rank's input, cut the same way on every rank. Gloo's pairwise form only
    (``takes_pieces``), which sends each piece as it is: no flat copy of the input is made (Note [gradients sent
    from where autograd put them] in ``sharding/sharded_grad_reducer.py``). ``scratch``: (N-2) chunks, as
    ``receive_buffer_numel``. Not for fp16, which is divided before the sum (Note [when to average])."""
    world = group.size()
    assert world > 1, "a world of one has nothing to exchange"
    assert len(chunks) == world, (len(chunks), world)
    assert all(sum(p.numel() for p in chunk) == output.numel() for chunk in chunks)
    assert output.dtype != torch.float16, "fp16 is averaged before the sum: reduce a flat copy"
    return _pairwise_reduce_scatter(output, [list(c) for c in chunks], group, scratch, stream, False, ())


def _pairwise_reduce_scatter(
    output: Tensor,
    chunks: list[list[Tensor]],
    group: ProcessGroup,
    scratch: Tensor | None,
    stream: CollectiveStream | None,
    divide_first: bool,
    held: tuple[Tensor, ...],
) -> PendingCollective:
    """Gloo's reduce-scatter (Note [reduce-scatter on gloo]) of ``chunks[r]``: rank r's chunk, in pieces."""
    world, rank = group.size(), group.rank()
    out = output.view(-1)
    own = chunks[rank]
    in_place = len(own) == 1 and _aliases(output, own[0])
    spare = _received_apart(world, in_place) * out.numel()
    if scratch is None and spare:
        scratch = torch.empty(spare, dtype=output.dtype, device=output.device)
    assert spare == 0 or (scratch is not None and scratch.numel() == spare), (spare, scratch)
    rows = iter(scratch.view(-1, out.numel()) if scratch is not None and spare else ())
    peers_in_order = [r for r in range(world) if r != rank]
    landing = {r: (out if (r == peers_in_order[0] and not in_place) else next(rows)) for r in peers_in_order}
    sizes = [piece.numel() for piece in own]  # how each peer cuts our chunk too

    def add(total: Tensor, r: int) -> None:
        if r != rank:
            total.add_(landing[r])
            return
        offset = 0
        for piece in own:
            if piece.data_ptr() != total[offset:].data_ptr():  # not our chunk itself (in place)
                total[offset : offset + piece.numel()].add_(piece)
            offset += piece.numel()

    def finish() -> None:
        # Sum in rank order, c0 + c1 first, into ``out`` when it holds one of the two, else into c0's receive row.
        holds = peers_in_order[0] if not in_place else rank
        total, first = (out, holds) if holds < 2 else (landing[0], 0)
        add(total, 1 - first)
        for r in range(2, world):
            add(total, r)
        if total.data_ptr() != out.data_ptr():
            out.copy_(total)
        if not divide_first:
            out.div_(world)

    exchange = [(r, chunks[r], list(landing[r].split(sizes))) for r in peers_in_order]
    buffers = (output, *held, *(p for chunk in chunks for p in chunk))
    return _exchange(Collective.REDUCE_SCATTER, exchange, group, REDUCE_SCATTER_TAG, buffers, finish, stream, scratch)


def _exchange(
    kind: Collective,
    exchange: Sequence[tuple[int, Sequence[Tensor], Sequence[Tensor]]],
    group: ProcessGroup,
    tag: int,
    buffers: tuple[Tensor, ...],
    finish: Callable[[], None] | None,
    stream: CollectiveStream | None,
    scratch: Tensor | None = None,
) -> PendingCollective:
    """Post, for each ``(peer, sends, receives)`` (``peer`` a rank of ``group``), an ``isend`` of every tensor of
    ``sends`` and an ``irecv`` into every tensor of ``receives``, in order, tagged ``tag`` (Note [pairwise tags])."""
    works: list[dist.Work] = []
    records: list[Send] = []
    with stream.launch() if stream is not None else nullcontext():
        for peer, sends, receives in exchange:
            other = dist.get_global_rank(group, peer)
            posted = [dist.isend(t, dst=other, group=group, tag=tag) for t in sends]
            posted += [dist.irecv(t, src=other, group=group, tag=tag) for t in receives]
            for work in posted:
                assert work is not None, "this rank is a member of the group"
                works.append(work)
            records += [Send("isend", t.numel(), t.dtype, nbytes(t), peer=other) for t in sends]
    held = buffers + (() if scratch is None else (scratch,))
    return PendingCollective(kind, tuple(works), held, tuple(records), finish, stream)


def all_reduce_sum(tensor: Tensor, group: ProcessGroup) -> PendingCollective:
    """Sum ``tensor`` in place across ranks (small tensors: norms, overflow flags)."""
    world = group.size()
    if world == 1:
        return PendingCollective(Collective.ALL_REDUCE, (), ())
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    send = make_send(dist.all_reduce, tensor, 2 * nbytes(tensor) * (world - 1) // world, group)
    return PendingCollective(Collective.ALL_REDUCE, (work,), (tensor,), (send,))
