"""ZeroStrategy through Lightning's Trainer: same losses and weights as Trainer(strategy="ddp")."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroOptimizer, ZeroStrategy
from lightning_zero.comm.pending_collective import Collective
from tests.harness import fresh_rendezvous_port, run_distributed
from tests.parity import build_model, build_optimizer, loss_fn

STEPS = 10


class ParityModule(pl.LightningModule):
    """The parity model under Lightning, with two param groups and a per-step LR schedule."""

    def __init__(self, model_name: str, optimizer_name: str) -> None:
        super().__init__()
        self.model_name = model_name
        self.optimizer_name = optimizer_name
        self.model = build_model(model_name)
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = loss_fn(self.model_name, self.model, batch)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.optimizer_name, self.model)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _dataset(model_name: str, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    if model_name == "mlp":
        return TensorDataset(torch.randn(samples, 12, generator=g), torch.randn(samples, 5, generator=g))
    tokens = torch.randint(0, 64, (samples, 17), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    """The Trainer every test here uses: 2 CPU processes, STEPS steps, nothing written to disk."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _full_weights(trainer: pl.Trainer, model: nn.Module) -> dict[str, Tensor]:
    """Every parameter in full (stage 3 gathers them for the copy)."""
    strategy = trainer.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroStrategy) else nullcontext()
    with context:
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def fit(strategy: Any, model_name: str, optimizer_name: str, accumulate: int = 1, **trainer_kwargs: Any) -> dict:
    module = ParityModule(model_name, optimizer_name)
    # Lightning adds a DistributedSampler: each rank sees its own half of the data, identically for every strategy.
    loader = DataLoader(_dataset(model_name, 2 * 4 * STEPS * accumulate), batch_size=4)
    trainer = _trainer(strategy, accumulate_grad_batches=accumulate, **trainer_kwargs)
    trainer.fit(module, loader)
    weights = _full_weights(trainer, module.model)
    result = {"losses": module.losses, "lrs": module.lrs, "weights": weights}
    if isinstance(trainer.strategy, ZeroStrategy):
        result["sent"] = trainer.strategy.communication_per_step()
        result["numel"] = sum(p.numel() for p in module.model.parameters())
    return result


def _ddp_then_zero(stage: int, model_name: str, optimizer_name: str, accumulate: int) -> list[dict]:
    reference = fit("ddp", model_name, optimizer_name, accumulate)
    sharded = fit(ZeroStrategy(stage=stage, bucket_numel=4_000), model_name, optimizer_name, accumulate)
    return [reference, sharded]


def assert_fits_match(reference: dict, sharded: dict) -> None:
    assert len(sharded["losses"]) == len(reference["losses"]) > 0
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    assert sharded["lrs"] == reference["lrs"]
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("model_name", "optimizer_name"), [("gpt", "adamw"), ("mlp", "sgd")])
def test_trainer_zero_matches_trainer_ddp(stage, model_name, optimizer_name):
    for reference, sharded in run_distributed(
        _ddp_then_zero, 2, stage, model_name, optimizer_name, 1, init_process_group=False
    ):
        assert_fits_match(reference, sharded)
        assert reference["lrs"][-1] < reference["lrs"][0]  # the schedule really ran
        padded_numel = 2 * sharded["sent"]["all_gather"] // 4  # bytes = 4 * padded * (N-1)/N at N = 2
        assert sharded["numel"] <= padded_numel < sharded["numel"] + 2 * 16  # < N padding per bucket
        assert sharded["sent"]["reduce_scatter"] == sharded["sent"]["all_gather"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2])
def test_trainer_zero_matches_ddp_with_accumulate_grad_batches(stage):
    for reference, sharded in run_distributed(_ddp_then_zero, 2, stage, "gpt", "adamw", 3, init_process_group=False):
        assert_fits_match(reference, sharded)


class _CountingCollectives(pl.Callback):
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.buckets = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        optimizer = trainer.strategy.optimizers[0]
        assert isinstance(optimizer, ZeroOptimizer)
        self.buckets = len(optimizer.buckets)
        self.calls.append(optimizer.ledger.calls.get(Collective.REDUCE_SCATTER, 0))


def _stage1_accumulation_calls() -> tuple[list[int], int]:
    counter = _CountingCollectives()
    fit(ZeroStrategy(stage=1, bucket_numel=10**9), "mlp", "sgd", accumulate=3, callbacks=[counter])
    return counter.calls, counter.buckets


@pytest.mark.timeout(120)
def test_stage1_accumulation_communicates_only_on_the_last_micro_batch():
    for calls, buckets in run_distributed(_stage1_accumulation_calls, 2, init_process_group=False):
        # One reduce-scatter per bucket every third micro-batch, none in between.
        assert buckets == 2  # the decay and no-decay param groups
        assert calls == [buckets * ((i + 1) // 3) for i in range(len(calls))]


@pytest.mark.timeout(240)
def test_spawn_launcher_trains_and_returns_weights_to_the_main_process():
    """Lightning's own multiprocessing launcher ("zero2_spawn"): no harness, results come back to this process.
    The DDP reference trains in the harness's ranks (forks of a preloaded server): the launcher under test is ZeRO's,
    and a second spawn would only import torch and Lightning twice more."""
    reference = run_distributed(fit, 2, "ddp", "mlp", "sgd", init_process_group=False)[0]
    fresh_rendezvous_port()
    sharded = fit("zero2_spawn", "mlp", "sgd")
    # The launcher returns rank 0's weights to the main process (losses stay in the children).
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
    for name, initial in build_model("mlp").named_parameters():
        assert not torch.allclose(sharded["weights"][name], initial), f"{name} was not trained"


def test_trainer_resolves_registered_names():
    trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.config.stage == 1


# -- stage 3 through the Trainer --------------------------------------------------------------------------------


class ConfigureModelModule(ParityModule):
    """Builds its model in ``configure_model``: on the meta device under stage 3, materialized unit by unit."""

    def __init__(self, model_name: str, optimizer_name: str) -> None:
        pl.LightningModule.__init__(self)
        self.model_name = model_name
        self.optimizer_name = optimizer_name
        self.model: nn.Module | None = None  # type: ignore[assignment]
        self.losses = []
        self.lrs = []
        self.built_on_meta = False

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.model_name)
            self.built_on_meta = all(p.is_meta for p in self.model.parameters())


def _fit_configure_model(strategy: Any) -> dict:
    module = ConfigureModelModule("gpt", "adamw")
    loader = DataLoader(_dataset("gpt", 2 * 4 * STEPS), batch_size=4)
    trainer = _trainer(strategy)
    trainer.fit(module, loader)
    weights = _full_weights(trainer, module.model)
    predictions = trainer.predict(module, DataLoader(_dataset("gpt", 8), batch_size=4))
    return {
        "losses": module.losses,
        "lrs": module.lrs,
        "weights": weights,
        "meta": module.built_on_meta,
        "predictions": predictions,
    }


def _ddp_then_zero3_configure_model() -> list[dict]:
    return [_fit_configure_model("ddp"), _fit_configure_model("zero3")]


@pytest.mark.timeout(180)
def test_zero3_builds_configure_model_on_meta_and_matches_ddp():
    for reference, sharded in run_distributed(_ddp_then_zero3_configure_model, 2, init_process_group=False):
        assert not reference["meta"]
        assert sharded["meta"]  # never materialized whole: sharded unit by unit in setup
        assert_fits_match(reference, sharded)
        for expected, got in zip(reference["predictions"], sharded["predictions"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _ddp_then_zero3(model_name: str) -> list[dict]:
    return [fit("ddp", model_name, "adamw"), fit(ZeroStrategy(stage=3), model_name, "adamw")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model_name", ["gpt", "transformer"])
def test_trainer_zero3_matches_trainer_ddp(model_name):
    for reference, sharded in run_distributed(_ddp_then_zero3, 2, model_name, init_process_group=False):
        assert_fits_match(reference, sharded)
        # Per step: 2 all-gathers (forward, backward) + 1 reduce-scatter of every parameter.
        assert sharded["sent"]["all_gather"] == 2 * sharded["sent"]["reduce_scatter"]


class ManualModule(ParityModule):
    """Manual optimization that keeps using the model after stepping, inside the same training_step."""

    def __init__(self) -> None:
        super().__init__("gpt", "sgd")
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = loss_fn(self.model_name, self.model, batch)
        self.manual_backward(loss)
        optimizer.step()
        with torch.no_grad():  # uses the parameters updated just now
            after = loss_fn(self.model_name, self.model, batch)
        self.losses.append(loss.item() + after.item())
        return loss


def _manual(strategy: Any) -> dict:
    module = ManualModule()
    loader = DataLoader(_dataset("gpt", 2 * 4 * STEPS), batch_size=4)
    trainer = _trainer(strategy)
    trainer.fit(module, loader)
    weights = _full_weights(trainer, module.model)
    return {"losses": module.losses, "lrs": [], "weights": weights}


def _manual_ddp_then_zero() -> list[dict]:
    return [_manual("ddp"), _manual("zero1"), _manual("zero2"), _manual("zero3")]


@pytest.mark.timeout(180)
def test_manual_optimization_that_reads_updated_weights_matches_ddp():
    for reference, *sharded in run_distributed(_manual_ddp_then_zero, 2, init_process_group=False):
        for run in sharded:
            assert_fits_match(reference, run)
