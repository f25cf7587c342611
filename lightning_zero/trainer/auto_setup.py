"""``ZeroStrategy(stage="auto")`` when fit starts: the prediction for each candidate, the choice, and its record.

The strategy chooses before ``configure_model`` runs when the module has one (so that a chosen stage 3 builds the
model on meta), predicting on a meta copy of the module whose ``configure_model`` runs there; otherwise at the start
of ``setup``, from the model built in ``__init__``. The micro-batch is the first batch of the training loader
(shapes only). Note [automatic configuration] in ``planning/auto_config.py`` says what is chosen and how.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_zero.compat import training_dataloader
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.auto_config import (
    Decision,
    agreed_budget,
    agreed_choice,
    candidates,
    decide,
    format_decision,
    local_budget,
    resolve_offload_dir,
)
from lightning_zero.planning.fake_step import meta_copy, release_fake_tensors
from lightning_zero.planning.module_step import predict_lightning_module
from lightning_zero.planning.peak import PeakPrediction
from lightning_zero.trainer.precision import ZeroPrecision

AUTO_KEY = "zero_auto"
"""Where a checkpoint keeps the decision (``Decision.record``), and the loggers' prefix for it."""


def choose_configuration(strategy: Any, trainer: pl.Trainer, module: pl.LightningModule, build_model: bool) -> Decision:
    """Predict, decide and report the configuration for ``strategy.config`` (which has ``auto``) on every rank.

    ``build_model``: ``configure_model`` has not run yet; it runs on a meta copy for the prediction.
    """
    config: ZeroConfig = strategy.config
    probe = meta_copy(module)
    if build_model:
        with torch.device("meta"):
            probe.configure_model()  # type: ignore[operator]
    batch = _first_batch(trainer)
    precision: ZeroPrecision = strategy.precision_plugin

    def context() -> AbstractContextManager[Any]:
        return precision.forward_context() if precision.param_dtype != torch.float32 else nullcontext()

    def predict(candidate: ZeroConfig) -> PeakPrediction:
        return predict_lightning_module(
            probe,
            batch,
            candidate,
            strategy.world_size,
            strategy.root_device,
            precision.param_dtype,
            precision.fp32_masters,
            context,
        )

    offload_dir = resolve_offload_dir(config, str(trainer.default_root_dir))
    budget = local_budget(config, strategy.root_device, strategy.num_processes, offload_dir)
    budget = agreed_budget(budget, strategy.process_group)
    options = candidates(config, strategy.num_processes, strategy.world_size)
    decision = decide(predict, options, budget, config.auto_headroom)
    release_fake_tensors()
    agreed_choice(decision, strategy.process_group)
    rank_zero_info(format_decision(decision))
    if decision.chosen < 0:
        raise RuntimeError(decision.refusal())
    record = {f"{AUTO_KEY}/{k}": v for k, v in decision.record().items()}
    for logger in trainer.loggers:
        logger.log_hyperparams(record)
    return decision


def _first_batch(trainer: pl.Trainer) -> Any:
    loader = training_dataloader(trainer)
    if loader is None:
        raise RuntimeError(
            "stage='auto' predicts the memory of a training step from the first training batch, and this fit has no "
            "training dataloader. HINT: pass train_dataloaders or a datamodule to fit, or set the stage yourself."
        )
    return next(iter(loader))
