"""``stage="auto"``: the cheapest configuration whose predicted peak fits the memory there is, chosen before setup.

Note [automatic configuration]
The candidates go from the least sharding to the most, each one moving more bytes per step than the one before it:
stage 1, stage 2, stage 3, stage 3 with the optimizer state in the host tier, with the parameter shards there too,
and with both in the disk tier (only where ``offload_dir`` is set). When the ranks span nodes, stage 3's candidates
use ZeRO++'s hpZ (secondary shards inside each node) and qwZ (int8 forward gathers), which cut the bytes that cross
nodes; the user's own ZeRO++ settings are kept when given. The first candidate that fits is chosen: its predicted
peak (Note [predicted peak]) plus ``auto_headroom`` of the budget fits in the device's budget, and what its tiers
place in host memory and on disk fits there. On a CPU device the host tier is the same memory as the device, so it
counts against the device's budget and never makes a configuration fit that the one before it did not. Every
other field (activation checkpointing, buckets, units, precision, micro-batch) is the user's.

The budgets are each rank's free memory (``auto_device_budget``/``auto_host_budget`` override them), reduced to
the smallest over all ranks with one all-reduce, and the predictions are computed identically on every rank from
the same model and micro-batch shape, so every rank makes the same choice; ``agreed_choice`` checks that it did.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_zero.config import ZeroConfig
from lightning_zero.planning.peak import PeakPrediction

_TIERS: tuple[tuple[str, str, str], ...] = (
    ("none", "none", "stage 3"),
    ("cpu", "none", "stage 3, optimizer in host memory"),
    ("cpu", "cpu", "stage 3, optimizer and parameters in host memory"),
    ("disk", "disk", "stage 3, optimizer and parameters on disk"),
)


class Budget(NamedTuple):
    """Bytes one rank may use, where."""

    device: int
    host: int
    disk: int
    host_is_device: bool
    """Whether the device is the host (a CPU run): the host tier then takes the device's memory."""


class Candidate(NamedTuple):
    name: str
    prediction: PeakPrediction
    moved: int
    """Bytes this rank moves per step: sent to other ranks, and between the device and its tiers."""
    fits: bool
    why: str


class Decision(NamedTuple):
    chosen: int
    """Index of the chosen candidate; -1 when none fits."""
    candidates: tuple[Candidate, ...]
    budget: Budget

    @property
    def config(self) -> ZeroConfig:
        if self.chosen < 0:
            raise RuntimeError(self.refusal())
        return self.candidates[self.chosen].prediction.config

    def refusal(self) -> str:
        smallest = min(self.candidates, key=lambda c: _needed(c.prediction, self.budget.host_is_device))
        return (
            f"stage='auto': no configuration fits the {_mb(self.budget.device)} of device memory per rank "
            f"(host {_mb(self.budget.host)}, disk {_mb(self.budget.disk)}); the smallest, {smallest.name}, needs "
            f"{_mb(_needed(smallest.prediction, self.budget.host_is_device))}. HINT: a smaller micro-batch, activation "
            "checkpointing (activation_checkpointing_policy), more ranks, or offload_dir for the disk tier.\n"
            + format_decision(self)
        )

    def record(self) -> dict[str, object]:
        """What a checkpoint and the logger keep of the decision: plain types only (``weights_only`` loads)."""
        chosen = self.config
        return {
            "candidate": self.candidates[self.chosen].name,
            "stage": chosen.stage,
            "offload_optimizer": chosen.offload_optimizer,
            "offload_params": chosen.offload_params,
            "hpz_partition_size": chosen.hpz_partition_size,
            "quantize_weights": chosen.quantize_weights,
            "predicted_peak_bytes": self.candidates[self.chosen].prediction.total,
            "device_budget_bytes": self.budget.device,
            "host_budget_bytes": self.budget.host,
            "disk_budget_bytes": self.budget.disk,
        }


def candidates(config: ZeroConfig, ranks_per_node: int, world_size: int) -> list[tuple[str, ZeroConfig]]:
    """The configurations ``stage="auto"`` considers, cheapest first (Note [automatic configuration])."""
    base = dataclasses.replace(config, auto=False, stage=3, offload_optimizer="none", offload_params="none")
    out: list[tuple[str, ZeroConfig]] = []
    for stage in (1, 2):
        out.append((f"stage {stage}", dataclasses.replace(base, stage=stage, **_ZEROPP_OFF)))  # type: ignore[arg-type]
    zeropp: dict[str, object] = {}
    spans_nodes = 1 < ranks_per_node < world_size and world_size % ranks_per_node == 0
    if spans_nodes and not config.uses_zeropp:
        zeropp = {"ranks_per_node": ranks_per_node, "hpz_partition_size": ranks_per_node, "quantize_weights": True}
    for optimizer, params, name in _TIERS:
        if optimizer == "disk" and config.offload_dir is None:
            continue
        fields = {"stage": 3, "offload_optimizer": optimizer, "offload_params": params, **zeropp}
        suffix = ", hpZ and qwZ across nodes" if zeropp else ""
        out.append((name + suffix, dataclasses.replace(base, **fields)))  # type: ignore[arg-type]
    return out


_ZEROPP_OFF: dict[str, object] = {"quantize_weights": False, "hpz_partition_size": 1, "quantize_gradients": False}


def _needed(prediction: PeakPrediction, host_is_device: bool) -> int:
    return prediction.total + (prediction.host if host_is_device else 0)


def moved_per_step(prediction: PeakPrediction, on_device_host: bool) -> int:
    """Bytes a rank moves per step: what it sends to other ranks, and what its tiers read and write (the disk tier
    reads and writes the masters, optimizer state and stage 3's gradient shards of the step and reads each parameter
    shard for the forward and the backward; the host tier of a GPU copies gradient shards down and parameter
    shards up, and parameter shards in the host tier up for both passes)."""
    config, state = prediction.config, prediction.state
    tier = 0
    if config.offload_optimizer == "disk":
        tier += 2 * (state.master_weights + state.optimizer_state + state.gradients)
    elif config.offload_optimizer == "cpu" and not on_device_host:
        tier += state.gradients + state.parameters
    if config.offload_params == "disk" or (config.offload_params == "cpu" and not on_device_host):
        tier += 3 * state.parameters  # read for the forward and the backward, written after the step
    return prediction.sent + tier


def decide(
    predict: Callable[[ZeroConfig], PeakPrediction],
    options: Sequence[tuple[str, ZeroConfig]],
    budget: Budget,
    headroom: float,
) -> Decision:
    """Predict each option in order and choose the first that fits (Note [automatic configuration]). Options after
    the chosen one are not predicted: they would only move more bytes."""
    found: list[Candidate] = []
    chosen = -1
    usable = int(budget.device * (1 - headroom))
    for name, config in options:
        prediction = predict(config)
        needed = _needed(prediction, budget.host_is_device)
        host = 0 if budget.host_is_device else prediction.host
        reasons = []
        if needed > usable:
            reasons.append(f"device needs {_mb(needed)} > {_mb(usable)}")
        if host > budget.host:
            reasons.append(f"host needs {_mb(host)} > {_mb(budget.host)}")
        if prediction.disk > budget.disk:
            reasons.append(f"disk needs {_mb(prediction.disk)} > {_mb(budget.disk)}")
        fits = not reasons
        why = "; ".join(reasons) if reasons else "fits"
        found.append(Candidate(name, prediction, moved_per_step(prediction, budget.host_is_device), fits, why))
        if fits:
            chosen = len(found) - 1
            break
    return Decision(chosen, tuple(found), budget)


def local_budget(config: ZeroConfig, device: torch.device, local_ranks: int, offload_dir: str | None) -> Budget:
    """This rank's share of free memory: the device's (CUDA: free memory; CPU: the host's available memory shared by
    its local ranks), the host's, and the disk of ``offload_dir``; each ``auto_*_budget`` field overrides its own."""
    host = _available_host_memory() // max(local_ranks, 1)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        device_bytes = free
    else:
        device_bytes = host
    disk = 0
    if offload_dir is not None:
        existing = Path(offload_dir)
        while not existing.exists() and existing != existing.parent:  # created at setup under its parent
            existing = existing.parent
        disk = shutil.disk_usage(existing).free // max(local_ranks, 1)
    return Budget(
        config.auto_device_budget if config.auto_device_budget is not None else device_bytes,
        config.auto_host_budget if config.auto_host_budget is not None else host,
        disk,
        device.type == "cpu",
    )


def agreed_budget(budget: Budget, group: dist.ProcessGroup | None) -> Budget:
    """The smallest budget of every rank, so that every rank decides from the same numbers."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return budget
    values = torch.tensor([budget.device, budget.host, budget.disk], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    device, host, disk = (int(v) for v in values.tolist())
    return Budget(device, host, disk, budget.host_is_device)


def agreed_choice(decision: Decision, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if the ranks chose differently (a model or micro-batch that differs between ranks)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    both = torch.tensor([decision.chosen, -decision.chosen], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != -int(both[1]):
        raise RuntimeError(
            "stage='auto': the ranks chose different configurations, so their models or first micro-batches differ. "
            "HINT: build the same model on every rank, or set the stage yourself."
        )


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def format_decision(decision: Decision) -> str:
    """The candidates considered, with their predicted peak and bytes moved per step, and which was chosen, why."""
    budget = decision.budget
    lines = [
        f"stage='auto': device budget {_mb(budget.device)} per rank"
        + ("" if budget.host_is_device else f", host {_mb(budget.host)}")
        + f", disk {_mb(budget.disk)} (Note [automatic configuration])",
        f"  {'candidate':<58} {'peak':>12} {'host':>12} {'disk':>12} {'moved/step':>12}  decision",
    ]
    for i, c in enumerate(decision.candidates):
        mark = "chosen" if i == decision.chosen else ("" if c.fits else "does not fit: ") + c.why
        p = c.prediction
        lines.append(
            f"  {c.name:<58} {_mb(p.total):>12} {_mb(p.host):>12} {_mb(p.disk):>12} {_mb(c.moved):>12}  {mark}"
        )
    return "\n".join(lines)


def resolve_offload_dir(config: ZeroConfig, root: str) -> str | None:
    """``offload_dir`` as the tiers will use it (relative paths under the Trainer's ``default_root_dir``)."""
    if config.offload_dir is None:
        return None
    path = Path(config.offload_dir)
    return str(path if path.is_absolute() else Path(root) / path)
