"""A predicted peak and the measured one, for the same LightningModule, configuration and micro-batch.

``predicted_and_measured`` runs inside a rank started by ``tests.harness.run_distributed(...,
init_process_group=False)``: it fits the module with a Trainer, measures the peak of the training steps as resident
memory above the process's memory before the model was built (``PeakProbe``, glibc told to return freed memory:
``memory_probe``), and predicts rank 0's peak for the same configuration and micro-batch
(``predict_lightning_module``, from a fresh module built on meta).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZeroConfig
from lightning_zero.planning.auto_config import Budget, Decision, candidates, decide
from lightning_zero.planning.fake_step import release_fake_tensors
from lightning_zero.planning.module_step import predict_lightning_module
from lightning_zero.trainer.auto_setup import AUTO_KEY
from tests import memory_probe
from tests.peak_models import CHECKPOINTED, MODELS, TINY, GPTModule, LlamaModule


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


# -- stage="auto" ---------------------------------------------------------------------------------------------------
AUTO_MODELS: dict[str, tuple[type[pl.LightningModule], dict[str, Any]]] = {
    "gpt": (GPTModule, {"n_layer": 12, "batch_size": 2}),
    "llama": (LlamaModule, {"layers": 8, "batch_size": 1}),
    "lora": (LlamaModule, {"layers": 8, "batch_size": 1, "lora": True}),
}
"""The models ``stage="auto"`` is checked on: deeper and with smaller micro-batches than ``MODELS``, so that model
state weighs against activations and each step of sharding changes the peak (and the disk tier's entries are small
next to the state it moves)."""

DISTINCT = 0.10
"""A candidate can be forced by a budget when it needs this much less than every candidate before it: closer than
that, the prediction's error (Note [predicted peak]) and what the decision itself leaves in the process (about 4 MB:
the fake copies' Python objects, the optimizer probe) could make either fit."""


def auto_decision(name: str, offload_dir: str, budget: Budget, world_size: int = 2) -> Decision:
    """What ``stage="auto"`` decides for the model ``name`` on a CPU with ``budget`` (predictions only)."""
    cls, args = AUTO_MODELS[name]
    module = cls(**args)
    with torch.device("meta"):
        module.configure_model()
    batch = next(iter(module.train_dataloader()))
    config = ZeroConfig(auto=True, offload_dir=offload_dir)

    def predict(candidate: ZeroConfig) -> Any:
        device = torch.device("cpu")
        return predict_lightning_module(module, batch, candidate, world_size, device, torch.float32, False, nullcontext)

    return decide(predict, candidates(config, world_size, world_size), budget, config.auto_headroom)


def auto_options(name: str, offload_dir: str) -> list[tuple[str, int]]:
    """Each candidate ``stage="auto"`` can be made to choose for the model ``name``, with a device budget that
    forces it: once the headroom is taken off, 2% below the least any earlier candidate needs (the first: twice what
    it needs), so that the run has all the room the choice allows."""
    everything = auto_decision(name, offload_dir, Budget(0, 0, 2**62, True))
    headroom = ZeroConfig().auto_headroom
    forced, least = [], None
    for candidate in everything.candidates:
        needed = candidate.prediction.total + candidate.prediction.host  # on a CPU the host tier is the device
        if least is None or needed < (1 - DISTINCT) * least:
            usable = 0.98 * least if least is not None else 2 * needed
            forced.append((candidate.name, int(usable / (1 - headroom))))
            least = needed
    return forced


def auto_fit(name: str, budget: int, root: str) -> dict[str, Any]:
    """Fit the model ``name`` under ``strategy="zero_auto"`` with a device budget, after the same warm-up as
    ``predicted_and_measured``: the candidate chosen, the peak measured, and what the checkpoint and the logger kept."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_zero.checkpoint.files import LIGHTNING_STATE_FILE

    memory_probe.return_freed_memory_to_the_kernel()
    cls, args = AUTO_MODELS[name]
    # The warm-up pays what a process's first stage-3 step and first decision leave behind whatever the model (17 MB
    # of thread pools, arenas and code; 9 MB of the fake-tensor machinery, 0.4 MB more for a second decision on the
    # LoRA model): a stage-3 fit of the model class at a tiny size and the decision's predictions for this model.
    _fit(cls(**{**args, **TINY[name]}), ZeroConfig(stage=3), 1, [])
    auto_decision(name, f"{root}/offload", Budget(0, 0, 0, True))
    release_fake_tensors()
    probe = PeakProbe()
    strategy = ZeroStrategy(stage="auto", auto_device_budget=budget, offload_dir="offload")
    logger = CSVLogger(root, name="logs")
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        default_root_dir=root,
    )
    trainer.fit(cls(**args))
    trainer.save_checkpoint(f"{root}/last.ckpt")
    assert strategy.auto_decision is not None
    chosen = strategy.auto_decision.candidates[strategy.auto_decision.chosen]
    return {
        "chosen": chosen.name,
        "config": strategy.config,
        "measured": probe.peak,
        "checkpoint": torch.load(Path(root, "last.ckpt", LIGHTNING_STATE_FILE), weights_only=True).get(AUTO_KEY),
        "hparams": Path(logger.log_dir, "hparams.yaml").read_text() if trainer.global_rank == 0 else "",
    }
