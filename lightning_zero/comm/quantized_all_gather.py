"""ZeRO++ qwZ: an all-gather that sends every shard block-quantized to int8 and dequantizes it on arrival.

Each rank quantizes its shard into one packed byte row (Note [block quantization] in ``quantization.py``), the rows
are all-gathered in place into a ``(world, row_bytes)`` buffer with the plain ``all_gather`` (so gloo's and NCCL's
forms and the metering are those of every other gather), and ``wait()`` dequantizes every row at once into the
output. Every rank, this one included, then holds the same dequantized values: ranks compute with one model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.comm.collectives import ProcessGroup, all_gather
from lightning_zero.comm.pending_collective import Collective, PendingCollective
from lightning_zero.comm.quantization import PackedLayout, dequantize_rows, quantize_rows
from lightning_zero.comm.streams import CollectiveStream


def quantized_all_gather(
    output: Tensor, input: Tensor, group: ProcessGroup, block: int, *, stream: CollectiveStream | None = None
) -> PendingCollective:
    """Gather every rank's ``input`` shard into ``output`` (world * shard elements), each quantized to int8 in
    blocks of ``block`` elements on the wire. ``input`` may be this rank's slice of ``output``."""
    world = group.size()
    shard = input.numel()
    assert output.numel() == shard * world, (output.shape, input.shape, world)
    if world == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return PendingCollective(Collective.ALL_GATHER, (), ())
    layout = PackedLayout(shard, block, 8)
    rows = torch.empty(world, layout.row_bytes, dtype=torch.uint8, device=input.device)  # (world, row_bytes)
    own = rows[group.rank()]
    quantize_rows(input.view(1, -1), block, 8, out=own.view(1, -1))
    pending = all_gather(rows.view(-1), own, group, stream=stream)

    def dequantize() -> None:
        output.view(world, shard).copy_(dequantize_rows(rows, shard, block, 8, output.dtype))

    pending.finish = dequantize
    pending.buffers = (*pending.buffers, output, input)
    return pending
