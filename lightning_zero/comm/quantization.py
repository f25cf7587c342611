"""Block quantization of flat tensors to int8 or int4, packed with their scales into one byte buffer per row.

Note [block quantization]
Symmetric, one scale per block of ``block`` consecutive elements: ``scale = amax(|x|) / qmax`` with ``qmax`` 127
(int8) or 7 (int4), ``q = round(x / scale)``, and back ``x' = q * scale``. Rounding to the nearest step makes the
error of every element at most ``scale / 2``; a block of zeros has scale 0 and comes back as zeros. Scales are fp32
(the input's dtype may be bf16, whose 8 bits of mantissa would add their own error to every element of the block).

Everything is vectorized over rows and blocks: the input is padded to whole blocks and viewed as ``(rows, blocks,
block)``, so one ``amax`` gives every scale and one division every code, with no Python loop over blocks. int4 codes
are stored offset by 8 (0..15), two per byte: element ``2i`` in the low nibble, ``2i + 1`` in the high one.

A row travels as one ``uint8`` buffer, ``[scales as bytes | codes | padding to 4 bytes]``, so that a collective
sends a row (a rank's shard, or its chunk for one peer) as a single tensor: on gloo, 4 ranks, 1M-element int8
shards, the gathers alone took 8.5 ms as one broadcast per rank of the packed row against 15.6 ms as separate code
and scale broadcasts (a quiet machine; ``benchmarks/zeropp_collectives.py`` times both end to end, quantization
included, and ``benchmarks/README.md`` has its figures). The scales come first so that their bytes are 4-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Bits = Literal[4, 8]
_QMAX: dict[int, int] = {8: 127, 4: 7}


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """The byte layout of one packed row of ``numel`` elements (Note [block quantization])."""

    numel: int
    block: int
    bits: Bits

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.block)

    @property
    def scale_bytes(self) -> int:
        return 4 * self.blocks

    @property
    def code_bytes(self) -> int:
        padded = self.blocks * self.block
        return padded if self.bits == 8 else -(-padded // 2)

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed row, a multiple of 4."""
        return -(-(self.scale_bytes + self.code_bytes) // 4) * 4


def quantize_rows(x: Tensor, block: int, bits: Bits, out: Tensor | None = None) -> Tensor:
    """Quantize each row of ``x`` (rows, numel) into a packed ``uint8`` buffer (rows, row_bytes)."""
    rows, numel = x.shape
    layout = PackedLayout(numel, block, bits)
    qmax = _QMAX[bits]
    blocks = _as_blocks(x, layout)  # (rows, blocks, block) fp32
    scales = blocks.abs().amax(dim=2).div_(qmax)  # (rows, blocks)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = blocks.div_(safe.unsqueeze(2)).round_().clamp_(-qmax, qmax).to(torch.int8).view(rows, -1)
    if out is None:
        out = torch.empty(rows, layout.row_bytes, dtype=torch.uint8, device=x.device)
    assert out.shape == (rows, layout.row_bytes), (out.shape, rows, layout)
    out[:, : layout.scale_bytes] = scales.view(torch.uint8)
    code_region = out[:, layout.scale_bytes : layout.scale_bytes + layout.code_bytes]
    if bits == 8:
        code_region.copy_(codes.view(torch.uint8))
    else:
        nibbles = (codes + 8).to(torch.uint8)
        if nibbles.shape[1] % 2:
            nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=8)
        pairs = nibbles.view(rows, -1, 2)
        code_region.copy_(pairs[:, :, 0] | (pairs[:, :, 1] << 4))
    out[:, layout.scale_bytes + layout.code_bytes :] = 0
    return out


def _as_blocks(x: Tensor, layout: PackedLayout) -> Tensor:
    """A fresh fp32 copy of ``x`` (rows, numel), zero-padded to whole blocks, as (rows, blocks, block)."""
    rows, numel = x.shape
    padded = torch.empty(rows, layout.blocks * layout.block, dtype=torch.float32, device=x.device)
    padded[:, :numel] = x
    padded[:, numel:] = 0
    return padded.view(rows, layout.blocks, layout.block)


def dequantize_rows(packed: Tensor, numel: int, block: int, bits: Bits, dtype: torch.dtype) -> Tensor:
    """The inverse of ``quantize_rows``: (rows, row_bytes) ``uint8`` to (rows, numel) of ``dtype``."""
    rows = packed.shape[0]
    layout = PackedLayout(numel, block, bits)
    scales = packed[:, : layout.scale_bytes].contiguous().view(torch.float32)  # (rows, blocks)
    code_region = packed[:, layout.scale_bytes : layout.scale_bytes + layout.code_bytes]
    if bits == 8:
        codes = code_region.contiguous().view(torch.int8).to(torch.float32)
    else:
        low = (code_region & 0x0F).to(torch.int8) - 8
        high = (code_region >> 4).to(torch.int8) - 8
        codes = torch.stack((low, high), dim=2).view(rows, -1)[:, : layout.blocks * block].to(torch.float32)
    values = codes.view(rows, layout.blocks, block).mul_(scales.unsqueeze(2))
    return values.view(rows, -1)[:, :numel].to(dtype)


def max_error(x: Tensor, block: int, bits: Bits) -> Tensor:
    """Per element, the bound on its quantization error: half its block's scale (Note [block quantization])."""
    rows, numel = x.shape
    layout = PackedLayout(numel, block, bits)
    scales = _as_blocks(x, layout).abs().amax(dim=2, keepdim=True) / _QMAX[bits]
    return (scales / 2).expand(rows, layout.blocks, block).reshape(rows, -1)[:, :numel]
