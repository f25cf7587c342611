"""The user's optimizers as ``ZeroOptimizer``s, as both front doors wrap them: one loss scaler each, the refusal of
a parameter two optimizers would shard, the memory tiers' space check and the communication ledger's topology."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.engine.model_sharding import ranks_per_node
from lightning_zero.engine.precision import ParameterPrecision
from lightning_zero.engine.tier_setup import check_optimizer_space
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.activation_checkpointing import parameter_names
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.zeropp import metering_topology


def wrap_optimizers(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    group: dist.ProcessGroup,
    config: ZeroConfig,
    precision: ParameterPrecision,
    gatherer: ParameterGatherer | None,
    tiers: MemoryTiers | None,
    num_processes: int,
) -> list[ZeroOptimizer]:
    """Wrap each of the model's ``optimizers`` (all of them, every time: one loss scaler per optimizer, Note [one
    loss scale per optimizer] in ``sharding/loss_scaler.py``). An optimizer that is a ``ZeroOptimizer`` already is
    kept, with its scaler replaced by the one of its place."""
    if gatherer is None:
        refuse_parameters_in_two_optimizers(module, optimizers)
    scalers = precision.loss_scalers_for(len(optimizers))
    wrapped: list[ZeroOptimizer] = []
    fresh: list[ZeroOptimizer] = []
    for optimizer, scaler in zip(optimizers, scalers, strict=True):
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.loss_scaler = scaler
            wrapped.append(optimizer)
            continue
        zero = ZeroOptimizer(
            module,
            optimizer,
            group,
            config,
            gatherer,
            fp32_masters=precision.fp32_masters,
            loss_scaler=scaler,
            tiers=tiers.for_optimizer() if tiers is not None else None,
        )
        wrapped.append(zero)
        fresh.append(zero)
    if tiers is not None:
        check_optimizer_space(tiers, wrapped, num_processes)
    if gatherer is None:  # stage 3's ledger has its topology from shard_module
        per_node = ranks_per_node(config, num_processes, group.size())
        topology = metering_topology(dataclasses.replace(config, ranks_per_node=per_node), group)
        for zero in fresh:
            zero.ledger.topology = topology
    return wrapped


def as_zero_optimizer(optimizer: Any) -> ZeroOptimizer:
    """The ``ZeroOptimizer`` a strategy handed out, from under Lightning's wrapper (``LightningOptimizer`` in manual
    optimization) or Fabric's."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"ZeroStrategy expected a ZeroOptimizer but got {type(optimizer).__name__}. HINT: do not replace the "
            "optimizers the strategy set up (`trainer.optimizers`, what `fabric.setup` returned); return your "
            "optimizers from `configure_optimizers`, or pass them to `fabric.setup`."
        )
    return optimizer


def refuse_parameters_in_two_optimizers(module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Stages 1 and 2: refuse a trainable parameter that two optimizers step, before either is sharded.

    Each ``ZeroOptimizer`` there lays its parameters out in flat buckets of its own (``FlatBucket``), and a parameter
    is a view into one bucket only: the second optimizer would take it from the first, whose step would then update
    a copy nobody reads (stage 1 trained silently wrong weights; stage 2 failed in backward). Stage 3's buckets belong
    to the sharded model, which every optimizer shares, so there it trains as DDP does."""
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        if isinstance(optimizer, ZeroOptimizer):
            params = [p for bucket in optimizer.buckets for p in bucket.params]
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            if not p.requires_grad or owner.setdefault(id(p), i) == i:
                continue
            first = owner[id(p)]
            name = parameter_names(module).get(id(p), f"of shape {tuple(p.shape)}")
            raise ValueError(
                f"Parameter {name!r} is stepped by two optimizers, #{first} ({type(optimizers[first]).__name__}) and "
                f"#{i} ({type(optimizer).__name__}). At ZeRO stages 1 and 2 each optimizer shards its parameters "
                "into flat buckets of its own, and a parameter lives in one bucket only. HINT: give each parameter "
                "to one optimizer, or use ZeroStrategy(stage=3), whose sharded parameters every optimizer shares."
            )
