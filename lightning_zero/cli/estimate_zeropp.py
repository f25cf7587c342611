"""``python -m lightning_zero estimate ... --ranks-per-node R``: what ZeRO++ changes at stage 3, by formula.

Note [ZeRO++ traffic formulas]
Per rank and step, Ψ parameters of b bytes on N ranks, R per node (n = N / R nodes), and q bytes per quantized
element (int8: 1, int4: 1/2, plus a 4-byte scale per block of B), with the ring-free model of Note [bytes by link]
in ``comm/ledger.py`` (a collective over a group sends each peer an equal part):

- a plain collective of stage 3 sends Ψb(N-1)/N: Ψb(R-1)/N to the own node, Ψb(N-R)/N to other nodes;
- qwZ's forward all-gather: the same with int8 codes, Ψq₈(R-1)/N and Ψq₈(N-R)/N;
- hpZ's backward all-gather: each rank sends its Ψb/R secondary shard to the R-1 others of its node;
- qgZ's reduce-scatter: R-1 rows of nS quantized elements inside the node, Ψq(R-1)/R, then n-1 chunks of S = Ψ/N
  across nodes, Ψq(n-1)/N.

Padding (each bucket to N shards, each shard to whole blocks) is ignored: the figures are the formula's.
"""

from __future__ import annotations

from typing import NamedTuple


class LinkBytes(NamedTuple):
    """Bytes one rank sends in one step's collective: to its own node, and to other nodes."""

    collective: str
    intra_node: float
    inter_node: float


def quantized_bytes(bits: int, block: int) -> float:
    """Bytes per element on the wire with ``bits``-bit codes and a 4-byte scale per ``block`` elements."""
    return bits / 8 + 4 / block


def stage3_link_bytes(num_params: int, world: int, per_node: int, param_bytes: int) -> list[LinkBytes]:
    """Plain stage 3 (Note [ZeRO++ traffic formulas])."""
    psi, n, r = num_params, world, per_node
    one = LinkBytes("", psi * param_bytes * (r - 1) / n, psi * param_bytes * (n - r) / n)
    return [one._replace(collective=c) for c in ("forward all-gather", "backward all-gather", "reduce-scatter")]


def zeropp_link_bytes(
    num_params: int, world: int, per_node: int, param_bytes: int, block: int, gradient_bits: int
) -> list[LinkBytes]:
    """Stage 3 with qwZ, hpZ over the node and qgZ (Note [ZeRO++ traffic formulas])."""
    psi, n, r = num_params, world, per_node
    nodes = n // r
    q8, qg = quantized_bytes(8, block), quantized_bytes(gradient_bits, block)
    return [
        LinkBytes("forward all-gather (qwZ)", psi * q8 * (r - 1) / n, psi * q8 * (n - r) / n),
        LinkBytes("backward all-gather (hpZ)", psi * param_bytes * (r - 1) / r, 0.0),
        LinkBytes("reduce-scatter (qgZ)", psi * qg * (r - 1) / r, psi * qg * (nodes - 1) / n),
    ]


def format_zeropp(
    num_params: int, world: int, per_node: int, param_bytes: int, block: int = 2048, gradient_bits: int = 4
) -> str:
    """The ZeRO++ section of ``estimate``: per-link bytes of plain stage 3 and of ZeRO++, and hpZ's memory."""
    if per_node <= 0 or world % per_node:
        raise ValueError(
            f"Invalid --ranks-per-node: {per_node} for N = {world}. Expected a divisor of the number of ranks."
        )
    plain = stage3_link_bytes(num_params, world, per_node, param_bytes)
    zeropp = zeropp_link_bytes(num_params, world, per_node, param_bytes, block, gradient_bits)
    lines = [
        f"ZeRO++ at stage 3 with {per_node} ranks per node ({world // per_node} nodes): qwZ int8, hpZ over the node, "
        f"qgZ int{gradient_bits}, {block} elements per scale. Bytes each rank sends per step (GB), own node / other "
        "nodes:",
        "",
    ]
    width = max(len(row.collective) for row in plain + zeropp)
    for title, rows in (("stage 3", plain), ("stage 3 + ZeRO++", zeropp)):
        lines.append(f"{title}:")
        lines += [
            f"  {r.collective.ljust(width)}  {r.intra_node / 1e9:10.3f}  {r.inter_node / 1e9:10.3f}" for r in rows
        ]
        total_intra, total_inter = sum(r.intra_node for r in rows), sum(r.inter_node for r in rows)
        lines.append(f"  {'total'.ljust(width)}  {total_intra / 1e9:10.3f}  {total_inter / 1e9:10.3f}")
    ratio = sum(r.inter_node for r in zeropp) / max(sum(r.inter_node for r in plain), 1e-30)
    lines += [
        "",
        f"to other nodes, ZeRO++ / stage 3: {ratio:.3f}. hpZ's secondary shards: "
        f"{num_params * param_bytes / per_node / 1e9:.3f} GB per rank between a unit's forward and its backward.",
    ]
    return "\n".join(lines)
