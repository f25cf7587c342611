"""The pictures ``python -m lightning_zero estimate`` draws, from the same numbers its tables print.

- ``--plot FILE``: each stage's model state per rank, split by where it lives between uses (the device, the host
  tier, the disk tier) without memory tiers, with the host tier and with the disk tier, one panel per world size
  of ``--plot-gpus`` (by default ``--gpus``; ``plot_memory_by_tier``).
- ``plot_link_bytes``: the bytes a rank sends per step to its own node and to other nodes, plain stage 3 against
  ZeRO++, by collective (Note [ZeRO++ traffic formulas] in ``estimate_zeropp.py``).

matplotlib is optional (``pip install "lightning-zero[plot]"``); nothing is imported from it until a picture is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_zero.cli.estimate_zeropp import LinkBytes
from lightning_zero.offload.memory_tiers import TierBytes
from lightning_zero.planning.model_state import model_state_by_tier

if TYPE_CHECKING:
    from lightning_zero.planning.layout import StageEstimate


class TierSetting(NamedTuple):
    """One way of placing the shards: ``ZeroConfig.offload_optimizer`` and ``offload_params``."""

    label: str
    """Under its bar in the picture."""
    optimizer: str
    params: str
    """Stage 3 only: stages 1 and 2 have no parameter shards to place."""


TIER_SETTINGS = (
    TierSetting("none", "none", "none"),
    TierSetting("host", "cpu", "cpu"),  # as the "zero2_offload" / "zero3_offload" presets
    TierSetting("disk", "disk", "disk"),  # as "zero3_offload_disk"
)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
PLACES = (("device", "tab:blue"), ("host", "tab:orange"), ("disk", "tab:gray"))
FLOOR = 1e6  # bytes: the log axis starts at 1 MB, so a bar whose device part is 0 still starts somewhere


def memory_by_tier(estimates: Sequence[StageEstimate], ratio: float = 1.0) -> dict[str, dict[str, TierBytes]]:
    """``{stage name: {tier setting's label: bytes on the device, in the host tier, in the disk tier}}``: what the
    picture draws for one world size. DDP has no tiers: it gets the untiered bar only."""
    out: dict[str, dict[str, TierBytes]] = {}
    for e in estimates:
        settings = TIER_SETTINGS if e.stage else TIER_SETTINGS[:1]
        out[STAGE_NAMES[e.stage]] = {
            s.label: model_state_by_tier(e.state, e.stage, s.optimizer, s.params if e.stage == 3 else "none", ratio)
            for s in settings
        }
    return out


def _human(nbytes: float) -> str:
    for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {name}"  # as the tables print them
    return f"{nbytes:.0f} B"


def plot_memory_by_tier(panels: Mapping[int, Sequence[StageEstimate]], path: Path, title: str, ratio: float) -> None:
    """One panel per world size: for each stage, a bar per tier setting, stacked by where its bytes live, labelled
    with what stays on the device. A log axis, so stage 3 at 1,024 ranks shows next to DDP."""
    plt = require_matplotlib()
    figure, axes_row = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.8), sharey=True, squeeze=False)
    width = 0.27
    top = max(e.state.total for estimates in panels.values() for e in estimates)
    for axes, (world, estimates) in zip(axes_row[0], panels.items(), strict=True):
        ticks: list[float] = []
        labels: list[str] = []
        for x, (stage, bars) in enumerate(memory_by_tier(estimates, ratio).items()):
            for i, (setting, tiers) in enumerate(bars.items()):
                position = x + (i - (len(bars) - 1) / 2) * width
                bottom = FLOOR
                for (place, colour), nbytes in zip(PLACES, tiers, strict=True):
                    if nbytes:
                        axes.bar(position, nbytes, width * 0.92, bottom=bottom, color=colour, label=place)
                        bottom += nbytes
                text = f"{_human(tiers.device)} on device" if tiers.device else "none on device"
                axes.annotate(text, (position, bottom), ha="center", va="bottom", rotation=90, fontsize=7)
                ticks.append(position)
                labels.append(setting if len(bars) > 1 else "")
            below = {"xycoords": ("data", "axes fraction"), "xytext": (0, -26), "textcoords": "offset points"}
            axes.annotate(stage, (x, 0), ha="center", fontsize=10, **below)
        axes.set_xticks(ticks, labels, fontsize=7)
        axes.set_yscale("log")
        axes.set_ylim(FLOOR, top * 40)  # room for the labels above the tallest bar
        axes.set_title(f"N = {world:,} ranks")
        axes.grid(axis="y", alpha=0.3)
    axes_row[0][0].set_ylabel("model state per rank between uses (bytes)")
    handles, names = axes_row[0][0].get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    axes_row[0][-1].legend(unique.values(), unique.keys(), loc="upper right", fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_link_bytes(runs: Mapping[str, Sequence[LinkBytes]], path: Path, title: str) -> None:
    """For each link (own node, other nodes) a bar per run, stacked by collective, in GB per rank and step."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(runs)
    colours = ("tab:blue", "tab:green", "tab:red")
    for i, (run, rows) in enumerate(runs.items()):
        for link, x in (("intra_node", 0), ("inter_node", 1)):
            position = x + (i - (len(runs) - 1) / 2) * width
            bottom = 0.0
            for colour, row in zip(colours, rows, strict=True):
                gigabytes = getattr(row, link) / 1e9
                axes.bar(position, gigabytes, width * 0.92, bottom=bottom, color=colour)
                bottom += gigabytes
            axes.annotate(f"{run}\n{bottom:.2f} GB", (position, bottom), ha="center", va="bottom", fontsize=8)
    # A colour is one collective of the step; each run names its own form of it ("forward all-gather (qwZ)").
    names = [" / ".join(dict.fromkeys(rows[j].collective for rows in runs.values())) for j in range(len(colours))]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in colours]
    axes.legend(handles, names, loc="upper left", fontsize=8)
    axes.set_xticks([0, 1], ["to its own node", "to other nodes"])
    axes.set_ylabel("bytes each rank sends per step (GB)")
    axes.set_ylim(0, axes.get_ylim()[1] * 1.2)
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only backend, or an error saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "estimate --plot needs matplotlib, which is not installed. "
            'HINT: pip install "lightning-zero[plot]" (or pip install matplotlib), or leave out --plot.'
        ) from error
    return plt
