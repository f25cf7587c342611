"""Runs for the tests of checkpoints under memory tiers, inside ranks started by ``tests.harness.run_distributed``:
a stage-3 GPT with every tier on disk, built on meta straight into the tiers, saved and loaded through them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.checkpoint.sharded_checkpoint import (
    load_checkpoint,
    save_sharded_checkpoint,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.offload.directory import OffloadDirectory
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from tests import memory_probe

_VOCAB = 512


@dataclass
class TieredGPT:
    """A GPT sharded at stage 3 into disk tiers, its optimizer and its tiers."""

    model: GPT
    gatherer: ParameterGatherer
    optimizer: ZeroOptimizer
    tiers: MemoryTiers


def build(
    n_layer: int, n_embd: int, offload_dir: str, seed: int, group: dist.ProcessGroup | None = None, **config: Any
) -> TieredGPT:
    group = group or dist.group.WORLD
    assert group is not None
    fields = {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", "max_inflight_buckets": 1}
    zero = ZeroConfig(**{**fields, **config, "offload_dir": offload_dir})
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=n_layer, n_embd=n_embd, n_head=8, vocab_size=_VOCAB, block_size=32))
    Path(offload_dir).mkdir(parents=True, exist_ok=True)
    tiers = MemoryTiers(zero, OffloadDirectory(Path(offload_dir), dist.get_rank()), io_entries=4)
    gatherer = shard_module(model, zero, group, torch.device("cpu"), tiers=tiers)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = ZeroOptimizer(model, adamw, group, zero, gatherer, tiers=tiers.for_optimizer())
    return TieredGPT(model, gatherer, optimizer, tiers)


def train(run: TieredGPT, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        tokens = torch.randint(0, _VOCAB, (1, 17), generator=torch.Generator().manual_seed(step))
        loss = run.model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        run.optimizer.clip_grad_norm_(1.0)
        run.optimizer.step()
        run.optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def save(run: TieredGPT, path: str, group: dist.ProcessGroup | None = None) -> None:
    """What ``ZeroStrategy.save_checkpoint`` writes, through the tiers."""
    group = group or dist.group.WORLD
    state = sharded_model_state(run.model, [run.optimizer], run.gatherer, run.tiers)
    optimizer_state = sharded_optimizer_state([run.optimizer], 0, run.tiers)
    checkpoint = {"state_dict": state, "optimizer_states": [optimizer_state]}
    save_sharded_checkpoint(checkpoint, path, group, {"world_size": dist.get_world_size(group), "stage": 3})


def load(run: TieredGPT, path: str, group: dist.ProcessGroup | None = None) -> None:
    group = group or dist.group.WORLD
    load_checkpoint(
        path, run.model, [run.optimizer], group, load_optimizer=True, gatherer=run.gatherer, tiers=run.tiers
    )


def full_weights(run: TieredGPT) -> dict[str, Tensor]:
    with run.gatherer.gathered():
        return {name: p.detach().clone() for name, p in run.model.named_parameters()}


def streamed_save_and_load(root: str) -> dict[str, Any]:
    """Train 2 steps with every tier on disk, save, load into a model initialized differently, and train both 2
    more steps. Also: the bytes resident in the tiers at the peak of the save and of the load, and a world-1 model
    (another world size) loading the same checkpoint."""
    rank = dist.get_rank()
    first = build(4, 128, f"{root}/tiers-a", seed=0)
    train(first, 2)
    swapper = first.tiers.swapper
    assert swapper is not None
    read_before = swapper.file.bytes_read
    swapper.reset_peak()
    save(first, f"{root}/ckpt")
    save_peak = swapper.peak_resident_nbytes
    save_read = swapper.file.bytes_read - read_before

    second = build(4, 128, f"{root}/tiers-b", seed=1)
    train(second, 1, first=100)  # its own optimizer state, which the load must replace
    other = second.tiers.swapper
    assert other is not None
    written_before = other.file.bytes_written
    other.reset_peak()
    load(second, f"{root}/ckpt")
    load_peak = other.peak_resident_nbytes
    load_written = other.file.bytes_written - written_before

    saved = full_weights(first)
    loaded = full_weights(second)
    continued, resumed = train(first, 2, first=2), train(second, 2, first=2)
    after_first, after_second = full_weights(first), full_weights(second)

    # Another world size: rank 0 alone, at stage 3 with the tiers on disk, loads what two ranks saved.
    alone = dist.new_group([0])
    single: dict[str, Tensor] | None = None
    if rank == 0:
        one = build(4, 128, f"{root}/tiers-c", seed=2, group=alone)
        load(one, f"{root}/ckpt", group=alone)
        single = full_weights(one)
        one.tiers.close()
    dist.barrier()
    entry_bytes = swapper.budget_bytes // swapper.io_entries
    # Parameters, Adam's moments (the fp32 parameters are their own masters): what a checkpoint holds of the tiers.
    kept = [swapper.tensor(k) for k in swapper.keys() if k[0] != "grad"]  # type: ignore[index]  # noqa: SIM118
    state_bytes = sum(t.numel() * t.element_size() for t in kept)
    for run in (first, second):
        run.tiers.close()
    return {
        "save_peak": save_peak,
        "load_peak": load_peak,
        "save_read": save_read,
        "load_written": load_written,
        "largest_entry": entry_bytes,
        "state_bytes": state_bytes,
        "saved": saved,
        "loaded": loaded,
        "continued": continued,
        "resumed": resumed,
        "after_first": after_first,
        "after_second": after_second,
        "single": single,
    }


def _checkpoint_peak(n_layer: int, root: str) -> tuple[int, int]:
    """Peak RSS of a save and a load of a GPT with every tier on disk, above the RSS before the save, and this rank's
    model-state bytes as stage 3 would hold them without tiers."""
    run = build(n_layer, 512, f"{root}/tiers-{n_layer}", seed=0)
    try:
        train(run, 1)
        memory_probe.reset_peak()
        before = memory_probe.rss_bytes()
        save(run, f"{root}/ckpt-{n_layer}")
        load(run, f"{root}/ckpt-{n_layer}")
        peak = memory_probe.peak_rss_bytes() - before
        numel = sum(p.numel() for p in run.model.parameters())
    finally:
        run.tiers.close()
    return peak, 16 * numel // dist.get_world_size()


def checkpoint_peaks(root: str, depths: list[int]) -> list[tuple[int, int]]:
    memory_probe.return_freed_memory_to_the_kernel()
    _checkpoint_peak(1, root)  # page in the code paths before measuring
    return [_checkpoint_peak(n_layer, root) for n_layer in depths]
