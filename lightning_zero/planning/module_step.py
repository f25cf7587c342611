"""What a prediction needs from a LightningModule: its optimizer (``configure_optimizers``) and its training step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.planning.fake_step import StepFn, loss_of
from lightning_zero.planning.peak import PeakPrediction, predict_peak


def first_optimizer(configured: Any) -> Optimizer:
    """The optimizer in what ``configure_optimizers`` returns, in any of the forms Lightning accepts (an optimizer,
    a list or tuple of them, ``([optimizers], [schedulers])``, a dict with ``"optimizer"``, a list of such dicts).
    With several, the first: the prediction lays out one optimizer's state."""
    if isinstance(configured, Optimizer):
        return configured
    if isinstance(configured, dict) and "optimizer" in configured:
        return first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return first_optimizer(configured[0])
    raise TypeError(
        f"configure_optimizers returned {type(configured).__name__}, in which no optimizer was found. HINT: the "
        "memory prediction lays out the optimizer's state; return an optimizer as Lightning documents."
    )


def training_step(context: Callable[[], AbstractContextManager[Any]]) -> StepFn:
    """The LightningModule's ``training_step`` on batch index 0, inside ``context`` (the precision's forward)."""

    def step(module: nn.Module, batch: Any) -> Tensor:
        with context():
            return loss_of(module.training_step(batch, 0))  # type: ignore[operator]

    return step


def predict_lightning_module(
    module: nn.Module,
    batch: Any,
    config: ZeroConfig,
    world_size: int,
    device: torch.device,
    param_dtype: torch.dtype,
    fp32_masters: bool,
    context: Callable[[], AbstractContextManager[Any]],
) -> PeakPrediction:
    """``predict_peak`` for a LightningModule whose model is built (``configure_model`` has run, on meta or not)."""
    return predict_peak(
        module,
        lambda copy: first_optimizer(copy.configure_optimizers()),  # type: ignore[operator]
        training_step(context),
        batch,
        config,
        world_size,
        device,
        param_dtype,
        fp32_masters,
        zero_grad_before_backward=True,  # Lightning's automatic optimization: forward, zero_grad, backward, step
    )
