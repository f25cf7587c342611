"""Optimizers and schedulers as Lightning drives them, under ZeRO stages 1, 2 and 3, against DDP: two optimizers
(a GAN, manual optimization with ``toggle_optimizer``), manual optimization with ``self.clip_gradients`` and closures,
LR schedulers per step, per epoch and on a plateau, and what ``LearningRateMonitor`` logs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.models.mlp import MLP
from tests.parity import build_optimizer, loss_fn
from tests.test_lightning_features import (
    STEPS,
    ZERO_RUNS,
    LitMLP,
    MemoryLogger,
    assert_every_stage_matches_ddp,
    feature_runs,
    fit,
    loader,
    make_trainer,
    summarize,
)

# Toggling freezes the other network's parameters, which plain DDP rejects as unused.
GAN_DDP = "ddp_find_unused_parameters_true"


class LitGAN(pl.LightningModule):
    """A small GAN under manual optimization: a generator (Adam) and a discriminator (SGD with a step schedule),
    each step toggling the optimizer it trains, as Lightning's GAN example does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(1234)
        self.generator = MLP(in_features=4, hidden=(16,), out_features=6)
        self.discriminator = MLP(in_features=6, hidden=(16,), out_features=1)
        self.losses: list[Any] = []
        self.lrs: list[list[float]] = []

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = batch[0]
        noise = torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        z = torch.randn(real.size(0), 4, generator=noise)
        ones, zeros = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        loss_d = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        loss_d = loss_d + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        loss_g = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.lr_schedulers().step()
        self.losses.append([loss_d.item(), loss_g.item()])

    def on_train_batch_end(self, *args: Any) -> None:
        self.lrs.append([g["lr"] for opt in self.trainer.optimizers for g in opt.param_groups])

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_d, step_size=3, gamma=0.5)]


def _gan(strategy: Any) -> dict:
    g = torch.Generator().manual_seed(7)
    real = TensorDataset(torch.randn(2 * 4 * STEPS, 6, generator=g) * 0.5 + 1.0)
    module = LitGAN()
    # Two optimizer steps per batch; the monitor logs the scheduled SGD and, unwrapped, the unscheduled Adam.
    trainer = make_trainer(
        strategy,
        max_steps=2 * STEPS,
        logger=MemoryLogger(),
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(log_momentum=True, log_weight_decay=True)],
    )
    trainer.fit(module, DataLoader(real, batch_size=4))
    return summarize(trainer, module)


class LitManual(LitMLP):
    """Manual optimization: two backward passes per step (the batch in halves), ``self.clip_gradients`` by norm,
    ``opt.step()`` with and without a closure, and a scheduler stepped by hand."""

    CLIP = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch

        def closure() -> float:
            optimizer.zero_grad()
            total = 0.0
            for half in (slice(0, 2), slice(2, 4)):
                loss = loss_fn("mlp", self.model, (x[half], y[half])) / 2
                self.manual_backward(loss)
                total += loss.item()
            if not isinstance(self.trainer.strategy, ZeroStrategy):  # DDP's parameters hold the reduced gradients
                self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item())
            self.clip_gradients(optimizer, gradient_clip_val=self.CLIP, gradient_clip_algorithm="norm")
            return total

        # Both ways Lightning documents: step after backward, and a closure that `step` runs.
        if batch_idx % 2:
            self.losses.append(closure())
            optimizer.step()
        else:
            optimizer.step(closure=lambda: self.losses.append(closure()))
        self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer("sgd", self.model)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


def _manual(strategy: Any) -> dict:
    module = LitManual()
    return {**fit(strategy, module), "norms": module.norms}


class LitScheduled(LitMLP):
    """Three schedulers on one optimizer: per step, per epoch, and ``ReduceLROnPlateau`` on a logged val metric."""

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer("sgd", self.model)
        self.schedulers = [
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8),
            # An improvement must beat the best loss by 1.0: only the first epoch does, every later one halves the LR.
            torch.optim.lr_scheduler.ReduceLROnPlateau(
                optimizer, factor=0.5, patience=0, threshold=1.0, threshold_mode="abs"
            ),
        ]
        step, epoch, plateau = self.schedulers
        return [optimizer], [
            {"scheduler": step, "interval": "step"},
            {"scheduler": epoch, "interval": "epoch"},
            {"scheduler": plateau, "interval": "epoch", "monitor": "val_loss"},
        ]


def _schedulers(strategy: Any) -> dict:
    module = LitScheduled()
    trainer = make_trainer(
        strategy,
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=4,
        limit_val_batches=2,
        logger=MemoryLogger(),
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(module, loader(2 * 4 * 4), loader(2 * 4 * 2))
    epochs = [s.last_epoch for s in module.schedulers]
    return {**summarize(trainer, module), "scheduler_epochs": epochs}


# -- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_gan_with_two_optimizers_and_toggle_optimizer_matches_ddp_under_every_stage():
    for runs in assert_every_stage_matches_ddp(_gan, GAN_DDP):
        lrs = runs["ddp"]["lrs"]
        assert lrs[-1][1] < lrs[0][1]  # the discriminator's schedule ran
        assert len({loss_g for _, loss_g in runs["ddp"]["losses"]}) > 1


@pytest.mark.timeout(240)
def test_manual_optimization_with_clip_gradients_matches_ddp_under_every_stage():
    for runs in assert_every_stage_matches_ddp(_manual):
        assert max(runs["ddp"]["norms"]) > LitManual.CLIP  # clipping took effect at least once


@pytest.mark.timeout(240)
def test_step_epoch_and_plateau_schedulers_match_ddp_under_every_stage():
    for runs in assert_every_stage_matches_ddp(_schedulers):
        for name in ("ddp", *ZERO_RUNS):
            # StepLR stepped every batch, ExponentialLR and ReduceLROnPlateau every epoch.
            assert runs[name]["scheduler_epochs"] == [12, 3, 3], name
        first, last = runs["ddp"]["lrs"][0][0], runs["ddp"]["lrs"][-1][0]
        # Lightning steps the schedulers before `on_train_batch_end`, where the LRs are read, except the plateau one,
        # which waits for the epoch's validation: 12 steps of StepLR (6 decays), 3 of ExponentialLR, and 2 of the
        # plateau scheduler (epoch 0 sets the best value, epoch 1 halves the LR) by the last read.
        assert last == pytest.approx(first * 0.7**6 * 0.8**3 * 0.5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("feature", "ddp"), [(_schedulers, "ddp"), (_gan, GAN_DDP)], ids=["schedulers", "gan"])
def test_learning_rate_monitor_logs_the_values_ddp_logs(feature, ddp):
    for runs in feature_runs(feature, ddp):
        expected = [(step, m) for step, m in runs["ddp"]["logged"] if any(k.startswith("lr-") for k in m)]
        assert expected, "LearningRateMonitor logged nothing"
        if feature is _gan:  # read through the wrapper: the scheduled SGD's groups and the unscheduled Adam's
            assert {"lr-SGD", "lr-SGD-momentum", "lr-Adam-momentum", "lr-Adam-weight_decay"} <= expected[0][1].keys()
        for name in ZERO_RUNS:
            got = [(step, m) for step, m in runs[name]["logged"] if any(k.startswith("lr-") for k in m)]
            assert got == expected, name
