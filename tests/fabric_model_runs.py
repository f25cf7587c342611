"""Fabric loops with several models, as Fabric's documentation and examples write them, under Fabric's DDP (the
oracle) and ``Fabric(strategy="zero*")``: a GAN (Lightning's Fabric DCGAN example, on small fully connected models
with BatchNorm as the example's have), a student distilled from a frozen teacher, a policy and a value network set up
one by one. Everything here runs inside a rank started by ``tests.harness.run_distributed`` with
``init_process_group=False``."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_zero import ZeroFabricStrategy
from tests.fabric_runs import make_fabric
from tests.parity import Run

NOISE, FEATURES, BATCH = 4, 8, 6


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(NOISE, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, FEATURES), nn.Tanh()
        )

    def forward(self, noise: Tensor) -> Tensor:
        out: Tensor = self.main(noise)
        return out


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(FEATURES, 16, bias=False), nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid()
        )

    def forward(self, sample: Tensor) -> Tensor:
        out: Tensor = self.main(sample)
        return out.view(-1)


def _data(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    real = torch.rand(BATCH, FEATURES, generator=generator) * 2 - 1
    return real, torch.randn(BATCH, NOISE, generator=generator)


def weights(fabric: Fabric, *models: Any) -> dict[str, Tensor]:
    """Every parameter and buffer of ``models`` in full, on every rank, as ``<index>.<name>``."""
    strategy = fabric.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroFabricStrategy) else nullcontext()
    found = {}
    with context:
        for i, model in enumerate(models):
            module = getattr(model, "module", model)
            for name, value in (*module.named_parameters(), *module.named_buffers()):
                found[f"{i}.{name}"] = value.detach().float().clone()
    return found


def gan_setup(fabric: Fabric, lr: float = 2e-3) -> tuple[Any, Any, Any, Any]:
    """The DCGAN example's set-up: each model with its Adam, set up together, the discriminator first."""
    torch.manual_seed(0)
    generator, discriminator = Generator(), Discriminator()
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999))
    discriminator, optimizer_d = fabric.setup(discriminator, optimizer_d)
    generator, optimizer_g = fabric.setup(generator, optimizer_g)
    return generator, discriminator, optimizer_g, optimizer_d


def gan_steps(fabric: Fabric, parts: tuple[Any, Any, Any, Any], start: int, stop: int) -> list[float]:
    """The DCGAN example's loop: the discriminator on a real and a fake batch, then the generator through it; each
    model's gradients zeroed with the model's ``zero_grad()`` as the example does."""
    generator, discriminator, optimizer_g, optimizer_d = parts
    criterion = nn.BCELoss()
    losses = []
    for step in range(start, stop):
        real, noise = _data(fabric.global_rank, step)
        ones, zeros = torch.ones(BATCH), torch.zeros(BATCH)
        discriminator.zero_grad()
        err_d_real = criterion(discriminator(real), ones)
        fabric.backward(err_d_real)
        fake = generator(noise)
        err_d_fake = criterion(discriminator(fake.detach()), zeros)
        fabric.backward(err_d_fake)
        optimizer_d.step()
        generator.zero_grad()
        err_g = criterion(discriminator(fake), ones)
        fabric.backward(err_g)
        optimizer_g.step()
        losses += [err_d_real.item(), err_d_fake.item(), err_g.item()]
    return losses


def gan(strategy: str | ZeroFabricStrategy, precision: str = "32-true", steps: int = 3) -> Run:
    fabric = make_fabric(strategy, precision)
    parts = gan_setup(fabric)
    run = Run(losses=gan_steps(fabric, parts, 0, steps))
    run.weights = weights(fabric, parts[0], parts[1])
    return run


def gan_ddp_and_zero(cases: list[tuple[dict[str, Any], str]]) -> list[list[Run]]:
    """[Fabric DDP, ZeRO] for each (ZeroConfig fields, precision)."""
    return [[gan("ddp", precision), gan(ZeroFabricStrategy(**fields), precision)] for fields, precision in cases]
