"""The memory report's chart: the model state per rank of every stage by the ZeRO paper's formula at a run's size,
next to what the run measured, as stacked bars (``MemoryReport(plot_path=...)``, ``estimate --plot``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_zero.planning.model_state import ModelStateBytes, expected_model_state_bytes
from lightning_zero.trainer.fit_report import FitReport

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def memory_by_stage(report: FitReport) -> dict[str, ModelStateBytes]:
    """The paper's per-rank model state for every stage at this run's model size, world size and precision."""
    measured = report.ranks[0].model_state
    sharded_state = report.stage is not None and report.stage >= 1
    elements = report.num_params / report.world_size if sharded_state else report.num_params
    # Infer the optimizer's bytes per parameter (8 for Adam in fp32) from what rank 0 holds.
    optimizer_bytes = round(measured.optimizer_state / elements) if elements else 0
    master_bytes = 0 if report.param_bytes >= 4 else 4
    return {
        name: expected_model_state_bytes(
            report.num_params, report.world_size, stage, report.param_bytes, master_bytes, optimizer_bytes
        )
        for stage, name in STAGE_NAMES.items()
    }


def plot_memory_by_stage(bars: Mapping[str, ModelStateBytes], path: Path, title: str) -> None:
    """One stacked bar (parameters, gradients, master weights, optimizer state) per entry, saved as a PNG."""
    plt = require_matplotlib()
    parts = ("parameters", "gradients", "master_weights", "optimizer_state")
    figure, axes = plt.subplots(figsize=(1.6 * len(bars) + 2, 4.5))
    bottoms = [0.0] * len(bars)
    scale, unit = _axis_unit(max(b.total for b in bars.values()))
    for part in parts:
        heights = [getattr(b, part) / scale for b in bars.values()]
        axes.bar(list(bars), heights, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        axes.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom")
    axes.set_ylabel(f"model state per rank ({unit})")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report_bars(report: FitReport) -> dict[str, ModelStateBytes]:
    """The formula for every stage, then what rank 0 measured in this run."""
    bars = memory_by_stage(report)
    if report.ranks:
        label = STAGE_NAMES.get(report.stage, report.strategy) if report.stage is not None else report.strategy
        bars[f"{label}\nmeasured"] = report.ranks[0].model_state
    return bars


def _axis_unit(largest: float) -> tuple[float, str]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= scale:
            return scale, unit
    return 1.0, "B"


def require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "MemoryReport(plot_path=...) needs matplotlib, which is not installed. "
            'HINT: pip install "lightning-zero[plot]" (or pip install matplotlib), or set plot_path=None.'
        ) from error
    return plt
