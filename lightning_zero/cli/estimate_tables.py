"""The tables ``python -m lightning_zero estimate`` prints: model state and traffic by stage, stage 3's units, tiers.

They own the words of their rows as well: the stage labels, the paper's formulas, and the names of the collectives,
by which ``estimate.py`` also keys the bytes it computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_zero.planning.layout import (
    ALL_REDUCE,
    GATHER_AFTER_STEP,
    GATHER_BACKWARD,
    GATHER_FORWARD,
    GATHER_PERSISTENT,
    REDUCE_SCATTER,
)
from lightning_zero.planning.model_state import model_state_by_tier

if TYPE_CHECKING:
    from lightning_zero.planning.layout import StageEstimate, UnitSize
    from lightning_zero.planning.peak import PeakPrediction

__all__ = [
    "ALL_REDUCE",
    "GATHER_AFTER_STEP",
    "GATHER_BACKWARD",
    "GATHER_FORWARD",
    "GATHER_PERSISTENT",
    "REDUCE_SCATTER",
    "format_estimates",
    "format_peaks",
    "format_tiers",
    "format_traffic",
    "format_units",
    "peak_intro",
]

STAGE_LABELS = {0: "DDP", 1: "1", 2: "2", 3: "3"}
FORMULAS = {0: "(2+2+K)Ψ", 1: "(2+2)Ψ + KΨ/N", 2: "2Ψ + (2+K)Ψ/N", 3: "(2+2+K)Ψ/N"}

TRAFFIC_FORMULAS = {ALL_REDUCE: "2Ψ(N-1)/N", GATHER_PERSISTENT: "-"}  # every other one: Ψ(N-1)/N


def _human(nbytes: int) -> str:
    """Decimal units, as the paper counts, each value in its own: stage 3's shards are MB where DDP's state is GB."""
    for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {name}"
    return f"{nbytes} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int) -> str:
    """Columns right-aligned, except the last ``text_columns`` (words), left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    first_text = len(header) - text_columns

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i >= first_text else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def format_estimates(estimates: Sequence[StageEstimate], exact: bool) -> str:
    """A table of model state, one row per stage. ``exact``: also the layout's bytes, to the byte, and padding."""
    header = ["stage", "params", "grads", "masters", "optim", "total", "sent/step"]
    if exact:
        header += ["total bytes", "formula bytes", "buckets", "padding"]
    header.append("formula")
    rows = []
    for e in estimates:
        s = e.state
        values = (s.parameters, s.gradients, s.master_weights, s.optimizer_state, s.total, e.sent)
        row = [STAGE_LABELS[e.stage], *(_human(v) for v in values)]
        if exact:
            row += [f"{s.total:,}", f"{e.formula.total:,}", str(e.buckets or "-"), f"{e.padding:,}"]
        rows.append([*row, FORMULAS[e.stage]])
    return _table(header, rows, text_columns=1)


def format_traffic(estimates: Sequence[StageEstimate], exact: bool) -> str:
    """A table of the bytes each rank sends per step, one row per stage and collective."""
    header = ["stage", "bytes", "", *(["formula bytes"] if exact else []), "formula", "collective"]
    rows = []
    for e in estimates:
        for t in e.traffic:
            paper = [f"{t.formula:,}"] if exact else []
            formula = TRAFFIC_FORMULAS.get(t.collective, "Ψ(N-1)/N")
            rows.append([STAGE_LABELS[e.stage], f"{t.sent:,}", _human(t.sent), *paper, formula, t.collective])
    return _table(header, rows, text_columns=2)


def format_units(stage3: StageEstimate, param_bytes: int) -> str:
    """Stage 3's units: how many, and the largest one, which every rank gathers in full while it runs."""
    root, largest = stage3.units[0], stage3.largest_unit
    assert largest is not None, "shard_module always makes a root unit"

    def size(u: UnitSize) -> str:
        return f"{u.name!r}, {u.numel:,} elements = {_human(u.numel * param_bytes)}"

    text = f"Stage 3: {len(stage3.units)} gather units; the largest, gathered in full on every rank while in use: "
    text += size(largest)
    if largest is not root:
        text += f"; the root unit, gathered around the whole forward and backward: {size(root)}"
    return text + "."


def format_tiers(estimates: Sequence[StageEstimate], optimizer: str, params: str, ratio: float) -> str:
    """Each stage's model state per rank split by where it lives between uses (device, host, disk)."""
    rows = []
    for e in estimates:
        # Tiers exist for ZeRO only, and parameter shards only at stage 3: other stages keep what they cannot move.
        tiers = model_state_by_tier(e.state, e.stage, optimizer if e.stage else "none", params, ratio)
        rows.append([STAGE_LABELS.get(e.stage, str(e.stage)), *(_human(v) for v in tiers), f"{sum(tiers):,}"])
    return _table(["stage", "device", "host", "disk", "total bytes"], rows, text_columns=1)


def peak_intro(peaks: Sequence[PeakPrediction], precision: str) -> str:
    config = peaks[0].config
    policy = config.activation_checkpointing_policy
    return (
        f"Peak memory of rank 0 in one training step (a step after the first; Note [predicted peak]), "
        f"{precision} parameters, activation checkpointing = {policy}, offload_optimizer = "
        f"{config.offload_optimizer}, offload_params = {config.offload_params}: the user's step run on fake tensors "
        "(activations, gradients as autograd makes them) with the engine's gathers and gradient buckets, over the "
        "model state above. 'device' is the peak; host and disk hold the tiers."
    )


def format_peaks(peaks: Sequence[PeakPrediction]) -> str:
    """Each stage's predicted peak per rank, split by kind."""
    header = ["stage", "params", "grads", "optim", "activations", "buffers", "device", "host", "disk", "peak in"]
    rows = []
    for p in peaks:
        values = (*p.peak, p.peak.total, p.host, p.disk)
        rows.append([STAGE_LABELS[p.config.stage], *(_human(v) for v in values), p.phase])
    return _table(header, rows, text_columns=1)
