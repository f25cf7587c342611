"""Lightning's own strategy behaviours, as its DDP and FSDP tests check them, under ``ZeroStrategy``: metrics built in
``configure_model``, optimizers that share parameters, ``configure_optimizers`` returning None, ``save_checkpoint``
onto an existing path, and a ``ckpt_path`` that does not exist. Each gives what Lightning's strategies give, or a
refusal of a type Lightning documents for it."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.full_save import save_full_checkpoint
from lightning_zero.checkpoint.sharded_checkpoint import load_checkpoint, save_sharded_checkpoint, sharded_model_state
from lightning_zero.models.mlp import MLP
from tests.harness import run_distributed
from tests.parity import build_model
from tests.test_strategy import _dataset

STEPS = 6


def _trainer(strategy: Any, root: str | None = None, devices: int = 2, steps: int = STEPS) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=root is not None,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _loader() -> DataLoader:
    return DataLoader(_dataset("mlp", 2 * 4 * STEPS), batch_size=4)


def _weights(trainer: pl.Trainer, model: nn.Module) -> dict[str, Tensor]:
    strategy = trainer.strategy
    gathered = strategy.gathered_parameters() if isinstance(strategy, ZeroStrategy) else nullcontext()
    with gathered:
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- torchmetrics built in configure_model (Note [metrics stay off meta]) ----------------------------------------
class WithMetric(pl.LightningModule):
    """The model and a ``torchmetrics`` metric built in ``configure_model``, the metric logged per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        import torchmetrics

        if self.model is None:
            self.model = build_model("mlp")
            self.mse = torchmetrics.MeanSquaredError()
            self.best = torchmetrics.MinMetric()  # its default is inf, which a meta tensor loses

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        out = self.model(batch[0])
        self.mse(out, batch[1])
        loss = nn.functional.mse_loss(out, batch[1])
        self.best(loss.detach())
        self.log_dict({"mse": self.mse, "best": self.best}, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def _metrics(strategy: Any) -> tuple[dict[str, float], list[str]]:
    module = WithMetric()
    trainer = _trainer(strategy)
    trainer.fit(module, _loader())
    states = [str(t.device) for t in (module.mse.sum_squared_error, module.best.min_value)]
    return {k: float(v) for k, v in trainer.callback_metrics.items()}, states


def _metrics_under_ddp_and_zero3() -> tuple[Any, Any]:
    return _metrics("ddp"), _metrics(ZeroStrategy(stage=3))


@pytest.mark.timeout(120)
def test_metrics_built_in_configure_model_at_stage_3_compute_what_ddp_computes():
    for (ddp, _), (zero, devices) in run_distributed(_metrics_under_ddp_and_zero3, 2, init_process_group=False):
        assert devices == ["cpu", "cpu"]  # not meta
        assert zero.keys() == ddp.keys() == {"mse", "best"}
        for key, value in ddp.items():
            assert zero[key] == pytest.approx(value, rel=1e-5), key


# -- two optimizers sharing parameters --------------------------------------------------------------------------------
class SharedParameters(pl.LightningModule):
    """Two optimizers over overlapping parameters (one over the whole model, one over its first layer), each
    stepping after its own backward, as in Lightning's manual optimization examples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MLP(in_features=12, hidden=(16,), out_features=5)
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        every = list(self.model.parameters())
        return [torch.optim.SGD(every, lr=0.1, momentum=0.9), torch.optim.Adam(every[:2], lr=1e-2)]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            loss = nn.functional.mse_loss(self.model(batch[0]), batch[1])
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def _shared(strategy: Any) -> dict[str, Tensor] | str:
    module = SharedParameters()
    trainer = _trainer(strategy)
    try:
        trainer.fit(module, _loader())
    except ValueError as error:
        return str(error)
    return _weights(trainer, module.model)


def _shared_under_every_strategy() -> dict[Any, Any]:
    return {"ddp": _shared("ddp"), **{stage: _shared(ZeroStrategy(stage=stage)) for stage in (1, 2, 3)}}


@pytest.mark.timeout(120)
def test_two_optimizers_sharing_parameters_train_as_ddp_at_stage_3_and_are_refused_at_stages_1_and_2():
    for runs in run_distributed(_shared_under_every_strategy, 2, init_process_group=False):
        for stage in (1, 2):  # refused at setup, before anything trained (stage 1 trained wrong weights silently)
            assert isinstance(runs[stage], str)
            assert "Parameter 'model.net.0.weight' is stepped by two optimizers, #0 (SGD) and #1 (Adam)" in runs[stage]
            assert "HINT" in runs[stage]
        ddp, zero = runs["ddp"], runs[3]
        assert isinstance(zero, dict)
        assert zero.keys() == ddp.keys()
        for name, value in ddp.items():
            torch.testing.assert_close(zero[name], value, rtol=1e-5, atol=1e-6, msg=name)


# -- configure_optimizers returning None -------------------------------------------------------------------------------
class NoOptimizer(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("mlp")
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.mse_loss(self.model(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> None:
        return None  # Lightning warns and trains without an optimizer


def _without_optimizer(strategy: Any, root: str) -> tuple[list[float], dict[str, Tensor]]:
    module = NoOptimizer()
    trainer = _trainer(strategy, root)  # ModelCheckpoint saves at the end of the epoch, as by default
    trainer.fit(module, _loader())
    return module.losses, _weights(trainer, module.model)


def _resumed_without_optimizer(stage: int, root: str) -> tuple[list[float], dict[str, Tensor]]:
    module = NoOptimizer()
    trainer = _trainer(ZeroStrategy(stage=stage), root, steps=2 * STEPS)
    trainer.fit(module, _loader(), ckpt_path=str(next(Path(root).rglob("*.ckpt"))))
    return module.losses, _weights(trainer, module.model)


def _without_optimizer_under_every_strategy(root: str) -> dict[Any, Any]:
    runs: dict[Any, Any] = {"ddp": _without_optimizer("ddp", f"{root}/ddp")}
    for stage in (1, 2, 3):
        runs[stage] = _without_optimizer(ZeroStrategy(stage=stage), f"{root}/{stage}")
    runs["resumed"] = _resumed_without_optimizer(3, f"{root}/3")
    return runs


@pytest.mark.timeout(150)
def test_configure_optimizers_returning_none_trains_without_an_optimizer_as_ddp(tmp_path):
    initial = dict(build_model("mlp").named_parameters())
    for runs in run_distributed(_without_optimizer_under_every_strategy, 2, str(tmp_path), init_process_group=False):
        ddp_losses, _ = runs["ddp"]
        assert len(ddp_losses) == STEPS
        for stage in (1, 2, 3, "resumed"):  # the last from the checkpoint ModelCheckpoint saved at stage 3
            losses, weights = runs[stage]
            assert len(losses) == STEPS
            if stage != "resumed":
                assert losses == pytest.approx(ddp_losses, rel=1e-6), stage
            for name, value in initial.items():  # nothing steps the weights
                assert torch.equal(weights[name], value.detach()), (stage, name)


# -- save_checkpoint onto an existing path (Note [what a save may replace]) -----------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(8,), out_features=3)


def _save(path: Path, full: bool = False) -> None:
    module = _mlp()
    checkpoint = {"epoch": 0, "global_step": 1, "state_dict": sharded_model_state(module, [])}
    if full:
        save_full_checkpoint(checkpoint, path, module, [], None)
    else:
        save_sharded_checkpoint(checkpoint, path, None, {"world_size": 1, "stage": 2})


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_save_checkpoint_replaces_a_checkpoint_but_never_a_directory_holding_other_files(tmp_path, full):
    checkpoint = tmp_path / "checkpoint.ckpt"
    _save(checkpoint)  # a sharded checkpoint first: the save replaces it, as FSDP's full save does
    _save(checkpoint, full)
    assert checkpoint.is_file() == full
    empty = tmp_path / "empty"
    empty.mkdir()
    _save(empty, full)  # an empty directory holds nothing to lose
    assert empty.exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("the user's")
    (run / "lightning_state.pt").write_text("not a checkpoint beside it, but still the user's")
    with pytest.raises(IsADirectoryError, match=r"run: it is a directory holding 1 file\(s\).*metrics\.csv.*HINT"):
        _save(run, full)
    assert sorted(p.name for p in run.iterdir()) == ["lightning_state.pt", "metrics.csv"]  # untouched
    assert not list(tmp_path.glob(".*"))  # nothing staged


def test_save_checkpoint_through_the_trainer_refuses_a_directory_holding_other_files(tmp_path):
    trainer = _trainer(ZeroStrategy(stage=2), devices=1)
    trainer.fit(NoOptimizer(), _loader())
    (tmp_path / "notes.txt").write_text("the user's")
    with pytest.raises(IsADirectoryError, match=r"notes\.txt"):
        trainer.save_checkpoint(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# -- a ckpt_path that does not exist ----------------------------------------------------------------------------------
def test_a_missing_checkpoint_raises_file_not_found_as_lightnings_checkpoint_io_does(tmp_path):
    trainer = _trainer(ZeroStrategy(stage=2), devices=1)
    with pytest.raises(FileNotFoundError, match=r"no-such\.ckpt does not exist"):
        trainer.fit(NoOptimizer(), _loader(), ckpt_path=str(tmp_path / "no-such.ckpt"))
    for missing in ("no-such.pt", "no-such.safetensors"):  # a full file, pretrained weights
        with pytest.raises(FileNotFoundError, match=r"no-such\.\w+ do(es)? not exist"):
            load_checkpoint(tmp_path / missing, _mlp(), [], None, load_optimizer=False)
