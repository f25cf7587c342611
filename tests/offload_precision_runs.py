"""Runs for ``tests/test_offload_precision.py``, inside ranks started by ``tests.harness.run_distributed``: the small
GPT of ``offload_runs`` trained through the Trainer under DDP, under ZeRO without tiers and under ZeRO with each
memory tier, in one precision."""

from __future__ import annotations

import traceback
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor

from lightning_zero import DynamicLossScaler, ZeroPrecision
from tests.offload_runs import forced_host_copies, train

FP16_SCALE = 2.0**8
"""fp16 runs start at a scale where neither DDP nor ZeRO overflows (as in ``test_mixed_precision``)."""


def _precision(strategy: str | dict[str, Any], precision: str) -> dict[str, Any]:
    """The Trainer's keywords for ``precision``: fp16 as a plugin (on the CPU ``precision="16-mixed"`` would
    become bf16 for DDP), the same start scale on both sides."""
    if precision != "16-mixed":
        return {"precision": precision}
    if strategy == "ddp":
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)
        return {"precision": None, "plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
    return {"precision": None, "plugins": [ZeroPrecision("16-mixed", loss_scaler=DynamicLossScaler(scale=FP16_SCALE))]}


def _run(strategy: str | dict[str, Any], root: str, precision: str, **kwargs: Any) -> dict[str, Any]:
    """One training run (a ``copies`` key in ``strategy``: the host tier's copy path forced), or the error it raised
    (as text, so one failing combination does not hide the others)."""
    copies = isinstance(strategy, dict) and bool(strategy.get("copies"))
    if isinstance(strategy, dict):
        strategy = {"bucket_numel": 3_000, **{k: v for k, v in strategy.items() if k != "copies"}}
    try:
        with forced_host_copies() if copies else nullcontext():
            return train(strategy, root, clip=0.05, accumulate=2, **_precision(strategy, precision), **kwargs)
    except Exception as error:  # a refusal or a crash: reported by the test with the combination's name
        return {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}


def tiers_in_precision(
    root: str, precision: str, stages: list[int], variants: dict[str, dict[str, Any]], ddp: bool = True
) -> dict[str, dict[str, Any]]:
    """DDP (unless ``ddp`` is False: the caller has it from another stage's run), ZeRO without tiers at each of
    ``stages``, and every variant (``copies``: the host tier's copy path forced), all in ``precision`` with clipping
    and accumulation."""
    runs = {"ddp": _run("ddp", root, precision)} if ddp else {}
    for stage in stages:
        runs[f"stage{stage}"] = _run({"stage": stage}, root, precision)
        # The kernels the optimizer's tiers choose (Note [tier step kernels]), chosen by the user here.
        runs[f"stage{stage}_fused"] = _run({"stage": stage}, root, precision, fused=True)
    for label, variant in variants.items():
        runs[label] = _run(variant, root, precision)
    return runs


def resume_in_precision(
    root: str, first: dict[str, Any], second: dict[str, Any], precision: str
) -> list[dict[str, Any]]:
    """``first`` trains 2 steps and saves; ``second`` resumes to step 4; ``first`` straight to 4 steps."""
    _run(first, root, precision, steps=2, save_to=f"{root}/mid")
    resumed = _run(second, root, precision, steps=4, ckpt_path=f"{root}/mid/epoch=0-step=2.ckpt")
    straight = _run(first, root, precision, steps=4)
    return [straight, resumed]


OVERFLOW_STEP = 2


class OverflowOnRank1(pl.Callback):
    """Makes every gradient of rank 1's first micro-batch of optimizer step ``OVERFLOW_STEP`` non-finite (the loss
    times inf), and records the loss scale after every step."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if trainer.global_rank == 1 and trainer.global_step == OVERFLOW_STEP and not self._poisoned:
            self._poisoned = True
            loss.register_hook(lambda grad: grad * float("inf"))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scaler = trainer.precision_plugin.loss_scaler  # type: ignore[attr-defined]
        self.scales.append(scaler.scale)

    _poisoned = False


def overflow_in_the_tiers(root: str, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """16-mixed, each variant with one overflow on rank 1: losses, weights and the loss scale after every batch."""
    runs = {}
    for label, variant in variants.items():
        overflow = OverflowOnRank1()
        run = _run(variant, root, "16-mixed", callbacks=[overflow])
        runs[label] = {**run, "scales": overflow.scales}
    return runs
