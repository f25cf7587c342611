"""Fabric loops with several models, as Fabric's documentation and examples write them, under Fabric's DDP (the
oracle) and ``Fabric(strategy="zero*")``: a GAN (Lightning's Fabric DCGAN example, on small fully connected models
with BatchNorm as the example's have), a student distilled from a frozen teacher, a policy and a value network set up
one by one. Everything here runs inside a rank started by ``tests.harness.run_distributed`` with
``init_process_group=False``."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
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


# -- distillation from a frozen teacher; a policy and a value network set up one by one ----------------------------
def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, outputs)
    )


def distill(strategy: str | ZeroFabricStrategy, precision: str = "32-true", steps: int = 3, accumulate: int = 2) -> Run:
    """A student distilled from a frozen teacher (KL to its soft targets), accumulating under ``no_backward_sync``,
    clipped. The teacher is set up under ZeRO (at stage 3 it is sharded, never whole on a rank); Fabric's DDP cannot
    wrap a module without trainable parameters, so there it is only moved to the device, as DDP loops do."""
    fabric = make_fabric(strategy, precision)
    torch.manual_seed(0)
    teacher = _mlp(FEATURES, 32, 5).requires_grad_(False).eval()
    student = _mlp(FEATURES, 16, 5)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    student, optimizer = fabric.setup(student, optimizer)
    teacher = fabric.setup_module(teacher) if isinstance(strategy, ZeroFabricStrategy) else teacher.to(fabric.device)
    run = Run(extra={"norms": []})
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            inputs = _data(fabric.global_rank, step * accumulate + micro)[0]
            with fabric.no_backward_sync(student, enabled=micro < accumulate - 1):
                with torch.no_grad():
                    soft = torch.softmax(teacher(inputs).float() / 2.0, dim=-1)
                log_probs = torch.log_softmax(student(inputs).float() / 2.0, dim=-1)
                loss = nn.functional.kl_div(log_probs, soft, reduction="batchmean") / accumulate
                fabric.backward(loss)
            total += loss.item()
        run.extra["norms"].append(float(fabric.clip_gradients(student, optimizer, max_norm=0.02)))
        optimizer.step()
        optimizer.zero_grad()
        run.losses.append(total)
    run.weights = weights(fabric, student, teacher)
    return run


def policy_value(strategy: str | ZeroFabricStrategy, precision: str = "32-true", steps: int = 3) -> Run:
    """A policy and a value network set up one by one (``setup_module`` each, then both optimizers in one
    ``setup_optimizers``), one loss through both, accumulated over two micro-batches under both models'
    ``no_backward_sync``, each model clipped with its optimizer and stepped."""
    fabric = make_fabric(strategy, precision)
    torch.manual_seed(0)
    policy, value = _mlp(FEATURES, 16, 3), _mlp(FEATURES, 16, 1)
    policy, value = fabric.setup_module(policy), fabric.setup_module(value)
    optimizer_p = torch.optim.Adam(policy.parameters(), lr=3e-3)
    optimizer_v = torch.optim.SGD(value.parameters(), lr=0.05, momentum=0.9)
    optimizer_p, optimizer_v = fabric.setup_optimizers(optimizer_p, optimizer_v)
    run = Run(extra={"norms": []})
    for step in range(steps):
        total = 0.0
        for micro in range(2):
            states = _data(fabric.global_rank, step * 2 + micro)[0]
            returns = states.sum(dim=-1)
            last = micro == 1
            with fabric.no_backward_sync(policy, enabled=not last), fabric.no_backward_sync(value, enabled=not last):
                log_probs = torch.log_softmax(policy(states), dim=-1)
                advantage = returns - value(states).view(-1)
                loss = (-(log_probs[:, 0] * advantage.detach()).mean() + advantage.pow(2).mean()) / 2
                fabric.backward(loss)
            total += loss.item()
        for model, optimizer in ((policy, optimizer_p), (value, optimizer_v)):
            run.extra["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=0.5)))
            optimizer.step()
            optimizer.zero_grad()
        run.losses.append(total)
    run.weights = weights(fabric, policy, value)
    return run


LOOPS = {"gan": gan, "distill": distill, "policy_value": policy_value}


def ddp_and_zero(cases: list[tuple[str, dict[str, Any], str]]) -> list[list[Run]]:
    """[Fabric DDP, ZeRO] for each (loop, ZeroConfig fields, precision)."""
    return [
        [LOOPS[loop]("ddp", precision), LOOPS[loop](ZeroFabricStrategy(**fields), precision)]
        for loop, fields, precision in cases
    ]


# -- checkpoints ------------------------------------------------------------------------------------------------------
def _gan_state(parts: tuple[Any, Any, Any, Any], **others: Any) -> dict[str, Any]:
    generator, discriminator, optimizer_g, optimizer_d = parts
    return {
        "generator": generator,
        "discriminator": discriminator,
        "optimizer_g": optimizer_g,
        "optimizer_d": optimizer_d,
        **others,
    }


def gan_resume(root: str, saving: dict[str, Any], loading: dict[str, Any]) -> dict[str, Any]:
    """The GAN trained 4 steps at once, and 2 steps, saved, loaded into a fresh Fabric with ``loading``'s ZeroConfig
    (another stage) and trained 2 more: the losses and weights of both, and the weights just after the load."""
    fabric = make_fabric(ZeroFabricStrategy(**saving))
    parts = gan_setup(fabric)
    uninterrupted = gan_steps(fabric, parts, 0, 4)
    final = weights(fabric, parts[0], parts[1])
    fabric = make_fabric(ZeroFabricStrategy(**saving))
    parts = gan_setup(fabric)
    gan_steps(fabric, parts, 0, 2)
    saved = weights(fabric, parts[0], parts[1])
    teacher = nn.Linear(3, 2)  # a module not set up: saved as its state dict, as Fabric's DDP saves it
    fabric.save(f"{root}/gan", _gan_state(parts, step=2, teacher=teacher))
    fabric = make_fabric(ZeroFabricStrategy(**loading))
    parts = gan_setup(fabric)
    fresh_teacher = nn.Linear(3, 2)
    state = _gan_state(parts, step=0, teacher=fresh_teacher)
    remainder = fabric.load(f"{root}/gan", state)
    loaded = weights(fabric, parts[0], parts[1])
    resumed = gan_steps(fabric, parts, state["step"], 4)
    return {
        "losses": (uninterrupted[6:], resumed),
        "final": (final, weights(fabric, parts[0], parts[1])),
        "saved": saved,
        "loaded": loaded,
        "remainder": remainder,
        "teacher": (teacher.state_dict(), fresh_teacher.state_dict()),
    }


def _one_step(fabric: Fabric, parts: tuple[Any, Any, Any, Any]) -> list[float]:
    return gan_steps(fabric, parts, 7, 8)


def partial_loads(strategy: str | ZeroFabricStrategy, root: str) -> dict[str, Any]:
    """Saves and loads of parts of a GAN's state as Fabric's documentation writes them; after each load one step
    shows what was restored (the losses depend on every weight and optimizer state). Run under Fabric's DDP and ZeRO
    alike, the observations must agree."""
    name = "ddp" if isinstance(strategy, str) else f"zero{strategy.config.stage}"
    path = f"{root}/{name}"
    seen: dict[str, Any] = {}
    fabric = make_fabric(strategy)
    parts = gan_setup(fabric)
    gan_steps(fabric, parts, 0, 2)
    teacher = nn.Linear(3, 2)
    fabric.save(path, _gan_state(parts, step=2, teacher=teacher, note="two steps"))
    seen["teacher"] = teacher.state_dict()

    def fresh(lr: float = 2e-3) -> tuple[Any, Any, Any, Any]:
        return gan_setup(fabric, lr)

    parts = fresh()  # only one optimizer's state: the models stay as initialized
    seen["optimizer_d"] = (fabric.load(path, {"optimizer_d": parts[3]}), _one_step(fabric, parts))
    parts = fresh()  # only the user's objects
    state: dict[str, Any] = {"step": 0, "note": None}
    remainder = fabric.load(path, state)
    seen["user"] = (remainder, state, _one_step(fabric, parts))
    parts = fresh()  # one model, and a module that was not set up
    teacher = nn.Linear(3, 2)
    seen["generator"] = (fabric.load(path, {"generator": parts[0], "teacher": teacher}), _one_step(fabric, parts))
    seen["loaded_teacher"] = teacher.state_dict()
    parts = fresh()  # the models and their optimizers, a key the checkpoint does not hold refused, then allowed
    state = _gan_state(parts, coconut=11)
    try:
        fabric.load(path, state)
    except KeyError as error:
        seen["strict"] = str(error)
    seen["not_strict"] = (fabric.load(path, state, strict=False), state["coconut"], _one_step(fabric, parts))
    seen["everything"] = sorted(fabric.load(path))  # no state: what Fabric returns of the checkpoint
    return seen


def partial_loads_under_ddp_and_zero(root: str) -> list[dict[str, Any]]:
    return [partial_loads("ddp", root), partial_loads(ZeroFabricStrategy(stage=3, bucket_numel=200), root)]


# -- exchanged with the Trainer ---------------------------------------------------------------------------------------
class GAN(pl.LightningModule):
    """The Trainer's GAN: the same two models as children named as the Fabric loop named them, their optimizers in
    the order the loop set them up."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)  # other weights than the Fabric run's: the load must replace them
        self.generator, self.discriminator = Generator(), Discriminator()
        self.automatic_optimization = False
        self.at_start: dict[str, Tensor] = {}

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
        ]

    def on_train_start(self) -> None:
        with self.trainer.strategy.gathered_parameters():  # type: ignore[attr-defined]
            self.at_start = {n: p.detach().clone() for n, p in self.named_parameters()}
        self.trainer.save_checkpoint(self.save_at)

    def training_step(self, batch: Any, index: int) -> None:
        optimizer_d, _ = self.optimizers()  # type: ignore[misc]
        loss = nn.functional.binary_cross_entropy(self.discriminator(batch[0]), torch.ones(BATCH))
        self.manual_backward(loss)
        optimizer_d.step()
        optimizer_d.zero_grad()


def gan_with_the_trainer(root: str) -> dict[str, Any]:
    """A Fabric GAN checkpoint (stage 3) resumed by a Trainer (stage 2) whose LightningModule holds both models; the
    Trainer's checkpoint loaded back into a Fabric with the two models set up apart."""
    fabric = make_fabric(ZeroFabricStrategy(stage=3))
    parts = gan_setup(fabric)
    gan_steps(fabric, parts, 0, 2)
    fabric.save(f"{root}/fabric", _gan_state(parts))
    saved = weights(fabric, parts[0], parts[1])
    module = GAN()
    module.save_at = f"{root}/trainer"  # type: ignore[assignment]
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=2, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.rand(BATCH * 2, FEATURES))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH), ckpt_path=f"{root}/fabric")
    fabric = make_fabric(ZeroFabricStrategy(stage=2))
    torch.manual_seed(9)
    parts = gan_setup(fabric)
    fabric.load(f"{root}/trainer", _gan_state(parts))
    return {"saved": saved, "trainer": module.at_start, "fabric": weights(fabric, parts[0], parts[1])}
