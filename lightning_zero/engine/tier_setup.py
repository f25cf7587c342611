"""A rank's memory tiers as a strategy holds them: built with the directory checks and the free-space checks, done
before anything is written (Note [tier directories] in ``offload/directory.py``); every shard brought into memory
for a while; closed at the end."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.engine.rank_layout import RankLayout
from lightning_zero.offload.directory import OffloadDirectory, check_free_space, resolve_offload_dir
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.offload.optimizer_tiers import OptimizerTiers
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer

_IO_ENTRIES = 4
"""Read-ahead and write-behind budgets, each in tier entries of the largest size (a bucket's parameter shard,
gradient shard or one optimizer-state tensor): a bucket's step reads four (gradient, parameters or masters, Adam's
two moments), so this keeps the next bucket's reads, and the previous bucket's writes, in flight."""


def build_memory_tiers(
    config: ZeroConfig,
    module: nn.Module,
    root_dir: str,
    ranks: RankLayout,
) -> MemoryTiers | None:
    """This rank's tiers, or None without offloading; a relative ``offload_dir`` is under ``root_dir`` (the Trainer's
    ``default_root_dir``). Refuses a bad directory or too little space first."""
    device, world_size, local_ranks = ranks.root_device, ranks.world_size, ranks.num_processes
    if config.offload_optimizer == "none" and config.offload_params == "none":
        return None
    if device.type != "cpu" and "disk" in (config.offload_optimizer, config.offload_params):
        field = "offload_optimizer" if config.offload_optimizer == "disk" else "offload_params"
        raise NotImplementedError(
            f"ZeroConfig.{field}='disk' on a {device.type} device is not implemented: the disk tier reads and writes "
            "host memory, and the staging copies between it and the device are not built. HINT: use 'cpu' (the "
            "host tier, Note [host tier data path] in lightning_zero/offload/host_copies.py) or 'none'."
        )
    directory = None
    if config.offloads_to_disk:
        assert config.offload_dir is not None
        base = resolve_offload_dir(config.offload_dir, root_dir)
        if config.offload_params == "disk":
            params = sum(p.numel() * p.element_size() for p in module.parameters())
            per_rank = -(-params // world_size)
            check_free_space(base, per_rank, local_ranks, "the parameter shards (offload_params='disk')")
        if config.offload_optimizer_state == "disk":  # Adam's two fp32 moments per trainable parameter
            moments = sum(8 * p.numel() for p in module.parameters() if p.requires_grad)
            check_free_space(
                base, -(-moments // world_size), local_ranks, "the moments (offload_optimizer_state='disk')"
            )
        directory = OffloadDirectory(base, ranks.global_rank)
    return MemoryTiers(config, directory, _IO_ENTRIES, device)


def check_optimizer_space(tiers: MemoryTiers, optimizers: list[ZeroOptimizer], local_ranks: int) -> None:
    """Before the first step creates any optimizer state: the disk must hold this rank's masters, optimizer state
    and (stage 3) gradient shards of the buckets placed on disk."""
    if tiers.directory is None:
        return
    needed = 0
    for optimizer in optimizers:
        placed = optimizer.tiers  # its own: a Fabric strategy's tiers also serve the optimizers of other models
        if not isinstance(placed, OptimizerTiers):
            continue
        per_element = _state_bytes_per_element(optimizer.optimizer)
        for seg, master in zip(optimizer.segments, optimizer.masters, strict=True):
            if id(seg.bucket) in placed.on_disk:
                needed += master.numel() * (per_element + 4)  # + the gradient shard (or the master run)
    # Tiers placed so far are already in the file; the rest must still fit.
    what = "the optimizer state, masters and gradients (offload_optimizer)"
    check_free_space(tiers.directory.base, needed, local_ranks, what)


def _state_bytes_per_element(optimizer: Optimizer) -> int:
    """Bytes of per-element state the optimizer keeps, found by stepping a copy of it on a small tensor."""
    probe = nn.Parameter(torch.zeros(16))
    probe.grad = torch.ones(16)
    hyper = {k: copy.deepcopy(v) for k, v in optimizer.param_groups[0].items() if k not in ("params", "param_names")}
    try:
        clone = type(optimizer)([{**hyper, "params": [probe]}])  # type: ignore[call-arg]
        clone.step()
    except Exception:
        return 8  # the optimizer cannot be rebuilt without its arguments: assume Adam's two fp32 moments
    return sum(v.element_size() for v in clone.state[probe].values() if isinstance(v, torch.Tensor) and v.numel() == 16)


@contextmanager
def shards_in_memory(tiers: MemoryTiers | None, optimizers: Iterable[ZeroOptimizer]) -> Iterator[None]:
    """Every shard of this rank (parameters, masters, optimizer state) in memory inside the context, put back into
    its tier afterwards; without tiers it does nothing. A delayed update still in flight lands first."""
    if tiers is None:
        yield
        return
    for optimizer in optimizers:
        optimizer.settle()  # Note [delayed parameter update] in offload/host_steps.py
    tiers.load_all()
    try:
        yield
    finally:
        tiers.unload_all()


def close_memory_tiers(tiers: MemoryTiers | None, optimizers: Iterable[ZeroOptimizer] | None) -> None:
    """The end of a rank's tiers. With the ``optimizers`` (a run that ends as planned) the last delayed update lands
    and every shard goes back where the model reads it (``restore``); in every case the tiers' IO stops and this
    rank's tier files are removed (Note [tier directories])."""
    if tiers is None:
        return
    if optimizers is not None:
        for optimizer in optimizers:
            optimizer.settle()  # the last delayed update reaches the model
        tiers.restore()
    tiers.close()
