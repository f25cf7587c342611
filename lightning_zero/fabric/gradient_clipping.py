"""``fabric.clip_gradients`` over shards: the ``ZeroOptimizer``'s clipping of the reduced gradients (Note [reduced
gradients live in the optimizer] in ``trainer/precision.py``), with the ``.grad`` a loop was shown kept (Note
[gradients between backward and step] in ``visible_gradients.py``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.optimizer_wrapping import as_zero_optimizer
from lightning_zero.fabric.models import SetUpModels
from lightning_zero.fabric.visible_gradients import LoopGradients
from lightning_zero.fabric.zero_grad import engine_call


def clip_by_norm(
    models: SetUpModels,
    loop_gradients: LoopGradients,
    optimizer: Optimizer,
    max_norm: float | int,
    norm_type: float | int,
    error_if_nonfinite: bool,
) -> Tensor:
    """``ZeroFabricStrategy.clip_gradients_norm``: the total norm over every shard, as Fabric's DDP returns it."""
    zero = as_zero_optimizer(optimizer)
    # Note [model.zero_grad() reaches the shards] in fabric/zero_grad.py
    with engine_call(models), loop_gradients.kept():
        norm = zero.clip_grad_norm_(float(max_norm), float(norm_type))
    # A step that overflowed under loss scaling is skipped by every rank: its norm is expected to be infinite.
    if error_if_nonfinite and not zero._found_inf and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return norm


def clip_by_value(
    models: SetUpModels, loop_gradients: LoopGradients, optimizer: Optimizer, clip_val: float | int
) -> None:
    """``ZeroFabricStrategy.clip_gradients_value``: every element clamped, shard by shard."""
    with engine_call(models), loop_gradients.kept():
        as_zero_optimizer(optimizer).clip_grad_value_(float(clip_val))
