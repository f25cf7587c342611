"""ZeRO++ qgZ: the gradient reduce-scatter as a quantized, two-hop all-to-all (within the node, then across nodes).

Note [hierarchical reduce-scatter]
The group's W = n nodes x k ranks are numbered node-major (Note [node topology] in ``topology.py``), so the bucket
``input`` (W * S elements) is ``(n, k, S)``: chunk ``[m, l]`` belongs to the rank at position ``l`` of node ``m``.

1. Within the node: reorder to ``(k, n * S)``, one row per local position ``l``, quantize each row (int4 or int8,
   block scales: Note [block quantization] in ``quantization.py``) and all-to-all over the node's k ranks. The rank
   at position ``l`` receives its node's k rows for position ``l``, dequantizes them and sums in fp32: the node's
   partial sum of the chunks of every rank ``[m, l]``, ``(n, S)``.
2. Across nodes: quantize those n chunks (a row each) and all-to-all over the n ranks at position ``l`` of every
   node. Each receives the n node sums of its own chunk, dequantizes, sums in fp32 and divides by W.

Only the n - 1 quantized chunks of step 2 leave the node: with int4, an eighth of the bytes a bf16 reduce-scatter
sends to other nodes. Each hop adds at most half a block scale of rounding per element (of the values it
quantizes), so the result is the exact average up to the sum of those bounds over the ranks and hops.

Falls back to the exact ``reduce_scatter``: for a bucket whose quantized rows would not be smaller than its exact
reduce-scatter (a shard smaller than about a quarter block: padding it to a whole block of codes plus a scale sends
more than the shard itself), and for a world of one. Every rank takes the same branch: it depends only on the
bucket's size.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import Unpack

from lightning_zero.comm.collectives import ProcessGroup, ReduceScatterOptions, reduce_scatter
from lightning_zero.comm.pending_collective import Collective, PendingCollective, make_send
from lightning_zero.comm.quantization import Bits, PackedLayout, dequantize_rows, quantize_rows


class HierarchicalReduceScatter:
    """A drop-in for ``reduce_scatter`` over the group ``intra`` x ``inter`` (Note [hierarchical
    reduce-scatter]): called with the same arguments, returns a ``PendingCollective`` that averages into ``output``."""

    def __init__(self, intra: ProcessGroup, inter: ProcessGroup, bits: Bits, block: int) -> None:
        self.intra = intra
        self.inter = inter
        self.bits: Bits = bits
        self.block = block

    def quantized_bytes(self, shard: int) -> int:
        """Bytes this rank sends for a bucket of ``shard`` elements per rank, over both hops."""
        k, n = self.intra.size(), self.inter.size()
        first = PackedLayout(n * shard, self.block, self.bits).row_bytes * (k - 1)
        return first + PackedLayout(shard, self.block, self.bits).row_bytes * (n - 1)

    def __call__(
        self, output: Tensor, input: Tensor, group: ProcessGroup, **options: Unpack[ReduceScatterOptions]
    ) -> PendingCollective:
        stream = options.get("stream")
        k, n = self.intra.size(), self.inter.size()
        world = group.size()
        assert world == k * n, (world, k, n)
        shard = output.numel()
        exact_bytes = input.numel() * input.element_size() * (world - 1) // world
        if world == 1 or self.quantized_bytes(shard) >= exact_bytes:
            return reduce_scatter(output, input, group, **options)
        first = PackedLayout(n * shard, self.block, self.bits)
        second = PackedLayout(shard, self.block, self.bits)
        by_position = input.view(n, k, shard).transpose(0, 1).reshape(k, n * shard)  # (k, n * S)
        sent = quantize_rows(by_position, self.block, self.bits)  # (k, row_bytes)
        received = torch.empty_like(sent)
        outgoing = torch.empty(n, second.row_bytes, dtype=torch.uint8, device=input.device)
        incoming = torch.empty_like(outgoing)
        with stream.launch() if stream is not None else nullcontext():
            work = _all_to_all(received, sent, self.intra)
        sends = (
            make_send(dist.all_to_all_single, sent, first.row_bytes * (k - 1), self.intra),
            make_send(dist.all_to_all_single, outgoing, second.row_bytes * (n - 1), self.inter),
        )

        def finish() -> None:
            partial = dequantize_rows(received, n * shard, self.block, self.bits, torch.float32).sum(dim=0)
            quantize_rows(partial.view(n, shard), self.block, self.bits, out=outgoing)
            second_work = _all_to_all(incoming, outgoing, self.inter)
            if second_work is not None:
                second_work.wait()
            total = dequantize_rows(incoming, shard, self.block, self.bits, torch.float32).sum(dim=0)
            output.copy_(total.div_(world))

        works = () if work is None else (work,)
        buffers = (input, output, sent, received, outgoing, incoming)
        return PendingCollective(Collective.REDUCE_SCATTER, works, buffers, sends, finish, stream)


def _all_to_all(output: Tensor, input: Tensor, group: ProcessGroup) -> dist.Work | None:
    """All-to-all of equal rows; a group of one keeps its own row."""
    if group.size() == 1:
        output.copy_(input)
        return None
    work: dist.Work = dist.all_to_all_single(output, input, group=group, async_op=True)
    return work
