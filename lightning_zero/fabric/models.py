"""The models a ``ZeroFabricStrategy`` set up, each with what belongs to it alone.

Note [several models in one Fabric]
Fabric loops set up more than one model: a GAN's generator and discriminator with an optimizer each (Lightning's
Fabric DCGAN example), a student and a frozen teacher, a policy and a value network; together
(``fabric.setup(model, *optimizers)``) or one by one (``setup_module``, then ``setup_optimizers``). Each set-up model
is a ``SetUpModel``: at stage 3 its own units and gradient reducer (its own ``ParameterGatherer``), its optimizers
(each over its parameters alone, so at stages 1 and 2 with reducers of their own), whether it was built on meta, and
its buffer broadcast and ``no_backward_sync`` state, which under Fabric's DDP are per model too (each model is its
own ``DistributedDataParallel``). ``SetUpModels`` keeps them in set-up order, and every optimizer in set-up order
across models: the order checkpoints list optimizers in, and the order of the loss scalers (one per optimizer, Note
[one loss scale per optimizer] in ``sharding/loss_scaler.py``). The memory tiers are the strategy's, shared by every
model. An optimizer over the parameters of several set-up models is refused: each model's parameters are sharded,
reduced and checkpointed with that model.

The functions here do the engine's work for one model (``set_up_model``, ``set_up_optimizer``) over
``lightning_zero.engine``, which the Trainer's strategy stands on too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_zero.compat import sync_module_states
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.buffers import BufferBroadcast, broadcast_buffers
from lightning_zero.engine.model_sharding import on_meta, shard_for_stage3
from lightning_zero.engine.optimizer_wrapping import wrap_optimizers
from lightning_zero.engine.precision import ParameterPrecision
from lightning_zero.engine.rank_layout import RankLayout
from lightning_zero.fabric.module import ZeroForwardModule
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.activation_checkpointing import apply_activation_checkpointing_policy
from lightning_zero.sharding.gradient_reducer import GradientReducer
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.library_init import ParamInitFn
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer


@dataclass(eq=False)
class SetUpModel:
    """One model set up by ``ZeroFabricStrategy`` (Note [several models in one Fabric])."""

    module: Module
    """The user's model, sharded at stage 3."""
    forward_module: ZeroForwardModule
    """What ``setup_module`` returned for it (Note [marked forward methods] in ``fabric/module.py``)."""
    gatherer: ParameterGatherer | None
    """Stage 3: its units, gathers and gradient reducer; None at stages 1 and 2."""
    built_on_meta: bool
    """Whether stage 3 built it on the meta device and initialized it (no weights of its own)."""
    optimizers: list[ZeroOptimizer] = field(default_factory=list)
    """Its optimizers, in the order they were set up."""
    buffers: BufferBroadcast = field(default_factory=BufferBroadcast)
    """Whether its next forward takes rank 0's buffers (Note [buffers follow rank 0] in ``engine/buffers.py``),
    accumulating inside ``fabric.no_backward_sync`` of this model."""
    watched: dict[int, list[Parameter]] = field(default_factory=dict)
    """``id(optimizer)`` -> the parameters carrying its markers (Note [model.zero_grad() reaches the shards] in
    ``fabric/zero_grad.py``)."""
    markers: dict[int, Tensor] = field(default_factory=dict)
    """``id(parameter)`` -> the marker put in its ``.grad``."""

    def reducers(self) -> list[GradientReducer]:
        """Its gradient reducers: stage 3's (shared by its optimizers), or each optimizer's."""
        found = [o.reducer for o in self.optimizers]
        if self.gatherer is not None:
            found.append(self.gatherer.reducer)
        return list({id(r): r for r in found}.values())


class SetUpModels:
    """Every model set up, in set-up order, and every optimizer across them in set-up order."""

    def __init__(self) -> None:
        self.models: list[SetUpModel] = []
        self.optimizers: list[ZeroOptimizer] = []
        """Every model's optimizers, in the order they were set up (checkpoints list them in this order)."""

    def __iter__(self) -> Iterator[SetUpModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def of(self, obj: Any) -> SetUpModel | None:
        """The record of ``obj`` if it is a set-up model or what ``setup_module`` returned for one; else None."""
        return next((m for m in self.models if obj is m.module or obj is m.forward_module), None)

    def optimizer(self, obj: Any) -> ZeroOptimizer | None:
        """``obj`` if it is a set-up optimizer (or Fabric's wrapper of one); else None."""
        optimizer = getattr(obj, "_optimizer", obj)
        return optimizer if any(optimizer is o for o in self.optimizers) else None

    def model_of(self, optimizer: ZeroOptimizer) -> SetUpModel:
        return next(m for m in self.models if any(o is optimizer for o in m.optimizers))

    def holding(self, optimizer: Optimizer) -> SetUpModel:
        """The set-up model whose parameters ``optimizer`` was built over; refuses none, or several."""
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self.models if any(id(p) in wanted for p in m.module.parameters())]
        kind = type(optimizer).__name__
        if not owners:
            raise RuntimeError(
                f"ZeroFabricStrategy wraps an optimizer over a set-up model, and this {kind} holds parameters of none"
                f" of the {len(self.models)} model(s) set up. HINT: call `fabric.setup(model, optimizer)`, or `model ="
                " fabric.setup_module(model)` before `fabric.setup_optimizers(optimizer)`."
            )
        if len(owners) > 1:
            names = " and ".join(type(m.module).__name__ for m in owners)
            raise ValueError(
                f"{kind} holds parameters of several set-up models ({names}): ZeRO shards, reduces and checkpoints "
                "each model's parameters with that model. HINT: give each model an optimizer of its own, or put the "
                "models in one `nn.Module` and set that up."
            )
        return owners[0]


def refuse_auto(config: ZeroConfig) -> None:
    """``auto=True`` (``"zero_auto"``) needs what a Fabric loop hands over only after its models are set up."""
    if config.auto:
        raise NotImplementedError(
            "ZeroFabricStrategy does not take auto=True (strategy='zero_auto'): it chooses the stage and tiers from "
            "the predicted peak of one training step (the forward, loss and backward of a micro-batch, then the "
            "optimizer's step), before the model is built or sharded; a Fabric loop builds its model (at stage 3 "
            "under `fabric.init_module`) and sets it up before any batch, and computes its loss in its own code, "
            "which the strategy never sees. HINT: get the choice for your model and micro-batch from `python -m "
            "lightning_zero estimate --model <LightningModule> --auto` (or a Trainer with strategy='zero_auto') and "
            "give ZeroFabricStrategy its stage and offload_* fields."
        )


def set_up_model(
    module: Module, config: ZeroConfig, ranks: RankLayout, param_init_fn: ParamInitFn | None, tiers: MemoryTiers | None
) -> SetUpModel:
    """Shard ``module`` (stage 3) or synchronize it from rank 0 (stages 1 and 2): one more set-up model."""
    if config.stage != 3 and on_meta(module):
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device, which only stage 3 materializes. HINT: "
            "build it under `fabric.init_module(empty_init=False)` (or without it) at stages 1 and 2, or use "
            "stage 3."
        )
    # Before stage 3 forms its units, so that a checkpointed layer is still a unit (as under the Trainer).
    apply_activation_checkpointing_policy(module, config.activation_checkpointing_policy)
    gatherer = None
    built_on_meta = False
    if config.stage == 3:
        built_on_meta = on_meta(module)
        gatherer = shard_for_stage3(module, config, ranks, param_init_fn, tiers)
        broadcast_buffers(module, ranks.process_group)
    else:
        module.to(ranks.root_device)
        # Parameters are broadcast again bucket by bucket when an optimizer shards them; buffers only here.
        sync_module_states(module)
    return SetUpModel(module, ZeroForwardModule(module), gatherer, built_on_meta)


def set_up_optimizer(
    models: SetUpModels,
    optimizer: Optimizer,
    group: dist.ProcessGroup,
    config: ZeroConfig,
    precision: ParameterPrecision,
    tiers: MemoryTiers | None,
    num_processes: int,
) -> ZeroOptimizer:
    """``optimizer`` as a ``ZeroOptimizer`` over the set-up model whose parameters it holds."""
    model = models.holding(optimizer)
    optimizers = [*model.optimizers, optimizer]
    wrapped = wrap_optimizers(model.module, optimizers, group, config, precision, model.gatherer, tiers, num_processes)
    model.optimizers = wrapped
    models.optimizers.append(wrapped[-1])
    # One scaler per optimizer across models, in set-up order (wrap_optimizers numbered this model's alone).
    for zero, scaler in zip(models.optimizers, precision.loss_scalers_for(len(models.optimizers)), strict=True):
        zero.loss_scaler = scaler
    return wrapped[-1]
