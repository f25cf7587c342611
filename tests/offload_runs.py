"""Runs for the memory-tier tests, inside ranks started by ``tests.harness.run_distributed``: a small GPT trained
through Lightning's Trainer under DDP and under ZeRO with tiers, recording the loss of every step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_zero import ZeroStrategy
from tests.test_checkpoint_trainer import TinyGPT, weights


class RecordingGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


def train(
    strategy: str | dict[str, Any],
    root: str,
    steps: int = 4,
    clip: float | None = None,
    accumulate: int = 1,
    ckpt_path: str | None = None,
    save_to: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps; ``strategy``: "ddp" or ``ZeroStrategy`` keywords. Returns losses, weights and what the
    tier directory holds after the run."""
    module = RecordingGPT()
    callbacks = []
    if save_to is not None:  # saved during fit, where the tiers hold the optimizer state
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_train_steps=steps, save_top_k=-1))
    trainer = pl.Trainer(
        callbacks=callbacks,
        strategy=strategy if isinstance(strategy, str) else ZeroStrategy(**strategy),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=save_to is not None,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    offload = Path(root, "offload")
    mine = f"-rank{trainer.global_rank}-"  # this rank's; another rank may still be tearing down
    left = sorted(n for n in os.listdir(offload) if mine in n) if offload.exists() else []
    return {"losses": module.losses, "weights": weights(module), "left": left}


def compare(root: str, variants: list[dict[str, Any]], clip: float | None, accumulate: int) -> list[dict[str, Any]]:
    """DDP, then every variant, on the same data and seed."""
    return [train("ddp", root, clip=clip, accumulate=accumulate)] + [
        train(v, root, clip=clip, accumulate=accumulate) for v in variants
    ]


def resume_across_tiers(root: str, first: dict[str, Any], second: dict[str, Any]) -> list[dict[str, Any]]:
    """``first`` trains 2 steps and saves; ``second`` resumes to step 4; a run of ``first`` straight to 4 steps."""
    train(first, root, steps=2, save_to=f"{root}/mid")
    resumed = train(second, root, steps=4, ckpt_path=f"{root}/mid/epoch=0-step=2.ckpt")
    straight = train(first, root, steps=4)
    return [straight, resumed]
