"""A predicted peak and the measured one, for the same LightningModule, configuration and micro-batch.

``predicted_and_measured`` runs inside a rank started by ``tests.harness.run_distributed(...,
init_process_group=False)``: it fits the module with a Trainer, measures the peak of the training steps as resident
memory above the process's memory before the model was built (``PeakProbe``, glibc told to return freed memory:
``memory_probe``), and predicts rank 0's peak for the same configuration and micro-batch
(``predict_lightning_module``, from a fresh module built on meta).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.module_step import predict_lightning_module
from tests import memory_probe
from tests.peak_models import CHECKPOINTED, MODELS, TINY


class PeakProbe(pl.Callback):
    """Anonymous resident memory before the model is built (``setup`` runs before ``configure_model``) and the peak
    of the training steps above it: the kernel's high-water mark of the resident set, reset when training starts,
    less the pages of files (the libraries' code, which the first step pages in: 16 MB for the GPT) read when
    training ends (they only grow, and they are all in by the second step, where the peak is)."""

    def __init__(self) -> None:
        self.before = 0
        self.peak = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = memory_probe.anonymous_bytes()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        memory_probe.reset_peak()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peak = memory_probe.peak_rss_bytes() - memory_probe.file_bytes() - self.before


def build(name: str) -> pl.LightningModule:
    cls, args = MODELS[name]
    return cls(**args)


def zero_config(name: str, stage: int, checkpointing: bool, **fields: Any) -> ZeroConfig:
    policy = CHECKPOINTED[name] if checkpointing else None
    return ZeroConfig(stage=stage, activation_checkpointing_policy=policy, **fields)  # type: ignore[arg-type]


def predict(name: str, config: ZeroConfig, world_size: int) -> Any:
    module = build(name)
    with torch.device("meta"):
        module.configure_model()
    batch = next(iter(module.train_dataloader()))
    return predict_lightning_module(
        module, batch, config, world_size, torch.device("cpu"), torch.float32, False, nullcontext
    )


def _fit(module: pl.LightningModule, config: ZeroConfig, steps: int, callbacks: list[pl.Callback]) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(config),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module)


def predicted_and_measured(name: str, stage: int, checkpointing: bool, steps: int = 3) -> tuple[int, int, Any]:
    """(predicted bytes, measured bytes, the prediction's split) of rank 0 (every rank measures; rank 0 holds the
    most: Note [estimate for rank 0])."""
    memory_probe.return_freed_memory_to_the_kernel()
    config = zero_config(name, stage, checkpointing)
    # A process's first step starts thread pools and their allocator arenas and pages in code (about 17 MB for the
    # GPT at stage 3, the same at 3.3M and 12.9M parameters; 21 MB more the first time a Llama is built), so the
    # same model class at a tiny size pays it first.
    _fit(MODELS[name][0](**TINY[name]), config, 1, [])
    probe = PeakProbe()
    _fit(build(name), config, steps, [probe])
    prediction = predict(name, config, 2)  # after the fit, so that the measurement starts from a fresh heap
    return prediction.total, probe.peak, prediction.peak._asdict()
