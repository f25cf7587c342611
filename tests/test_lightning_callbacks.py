"""Lightning's callbacks and utilities that touch parameters, through the Trainer on two gloo ranks against DDP:
``StochasticWeightAveraging`` (DDP's weights at stages 1 and 2, refused at stage 3 before training),
``BaseFinetuning`` (refused before training), ``lightning_zero.grad_norm`` (DDP's norms at every stage, Lightning's
keys) and what ``.grad`` holds where users read it."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy
from tests.harness import run_distributed
from tests.test_checkpoint_trainer import weights

STEPS_PER_EPOCH = 3


class Net(pl.LightningModule):
    """A small MLP (one parameter unused every step) that records, in ``on_before_optimizer_step``, the norms
    ``lightning_zero.grad_norm`` gives, what Lightning's own ``grad_norm`` finds in ``.grad``, another reduction of a
    ``.grad`` and what an in-place write to one does."""

    def __init__(self, norm_type: float | str = 2.0, record: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.unused = nn.Linear(2, 2)
        self.norm_type = float(norm_type)
        self.record = record
        self.steps = 0
        self.norms: list[dict[str, float]] = []
        self.lightning_norms: list[dict[str, float]] = []
        self.after_backward: list[dict[str, float]] = []
        self.largest: list[float] = []
        self.write: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_after_backward(self) -> None:
        if not self.record:
            return
        self.after_backward.append(_floats(lightning_grad_norm(self, self.norm_type)))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.steps += 1
        if not self.record:
            return
        self.norms.append(_floats(lightning_zero.grad_norm(self, self.norm_type)))
        self.lightning_norms.append(_floats(lightning_grad_norm(self, self.norm_type)))
        grad = self.backbone[0].weight.grad
        self.largest.append(float(grad.abs().max()))  # not a norm: under ZeRO, the whole gradient is gathered
        try:
            grad.mul_(1.0)
            self.write = "written"
        except RuntimeError as error:
            self.write = str(error)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4 * 2 * STEPS_PER_EPOCH, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] * 2 - x[:, 1:2]), batch_size=4)


def _floats(norms: dict[str, Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in norms.items()}


def _weights(module: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _trainer(strategy: Any, callbacks: list[pl.Callback], root: str, epochs: int = 1) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


# -- StochasticWeightAveraging ---------------------------------------------------------------------------------------
def _swa() -> StochasticWeightAveraging:
    return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)


def _swa_runs(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    strategies: list[tuple[str, Any]] = [("ddp", "ddp_find_unused_parameters_true")]
    strategies += [(f"zero{s}", ZeroStrategy(stage=s)) for s in (1, 2)]
    for name, strategy in strategies:
        module = Net(record=False)
        _trainer(strategy, [_swa()], root, epochs=3).fit(module)
        out[name] = _weights(module)
    module = Net(record=False)
    try:
        _trainer(ZeroStrategy(stage=3), [_swa()], root, epochs=3).fit(module)
    except ValueError as error:
        out["zero3"] = (str(error), module.steps)
    return out


@pytest.mark.timeout(120)
def test_swa_gives_ddps_weights_at_stages_1_and_2_and_is_refused_before_training_at_stage_3():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_swa_runs, 2, root, init_process_group=False, timeout=110)
    for rank in results:
        initial = _weights(Net())
        assert any(not torch.allclose(rank["ddp"][k], initial[k]) for k in initial), "DDP trained"
        for stage in ("zero1", "zero2"):
            for k, expected in rank["ddp"].items():
                torch.testing.assert_close(rank[stage][k], expected, rtol=1e-5, atol=1e-6, msg=f"{stage} {k}")
        message, steps = rank["zero3"]
        assert "StochasticWeightAveraging" in message
        assert "HINT" in message
        assert "ShardedEMA" in message
        assert steps == 0, "refused before the first step"


# -- BaseFinetuning ----------------------------------------------------------------------------------------------------
class WithBackbone(Net):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _finetuning_run(root: str, stage: int) -> tuple[str, int]:
    module = WithBackbone(record=False)
    try:
        _trainer(ZeroStrategy(stage=stage), [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], root, 2).fit(module)
    except ValueError as error:
        return str(error), module.steps
    return "", module.steps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 3])
def test_base_finetuning_is_refused_before_training(stage):
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_finetuning_run, 2, root, stage, init_process_group=False, timeout=55)
    for message, steps in results:
        assert "BackboneFinetuning" in message, message
        assert "add_param_group" in message
        assert "HINT" in message
        assert steps == 0, "refused before the first step"


# -- grad_norm ---------------------------------------------------------------------------------------------------------
def _grad_norm_runs(root: str, norm_type: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    strategies: list[tuple[str, Any]] = [("ddp", "ddp_find_unused_parameters_true")]
    strategies += [(f"zero{s}", ZeroStrategy(stage=s, bucket_numel=100)) for s in (1, 2, 3)]
    for name, strategy in strategies:
        module = Net(norm_type)
        _trainer(strategy, [], root).fit(module)
        out[name] = (module.norms, module.lightning_norms, module.after_backward, module.largest, module.write)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, 1, "inf"])
def test_grad_norm_lightnings_and_ours_give_ddps_norms_and_grad_is_never_partial(norm_type):
    """Lightning's ``grad_norm``, unchanged, reads DDP's values through ``.grad`` in ``on_before_optimizer_step``
    (Note [gradients visible to hooks]); ``lightning_zero.grad_norm`` gives them in one collective."""
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_grad_norm_runs, 2, root, norm_type, init_process_group=False, timeout=110)
    for rank in results:
        ddp_norms, ddp_lightning, _, ddp_largest, ddp_write = rank["ddp"]
        assert ddp_write == "written"
        assert ddp_norms == ddp_lightning, "under DDP lightning_zero.grad_norm is Lightning's"
        assert len(ddp_norms) == STEPS_PER_EPOCH
        p = float(norm_type)
        assert f"grad_{p}_norm/backbone.0.weight" in ddp_norms[0]
        assert f"grad_{p}_norm_total" in ddp_norms[0]
        assert not any("unused" in k for k in ddp_norms[0]), "no gradient, no key (as Lightning)"
        for stage in (1, 2, 3):
            norms, lightning_norms, after_backward, largest, write = rank[f"zero{stage}"]
            assert len(norms) == len(lightning_norms) == len(ddp_norms)
            for step, lightnings, expected in zip(norms, lightning_norms, ddp_norms, strict=True):
                assert step.keys() == lightnings.keys() == expected.keys(), f"stage {stage}"
                assert step == pytest.approx(expected, rel=1e-5), f"stage {stage}"
                assert lightnings == pytest.approx(expected, rel=1e-5), f"stage {stage}"
            assert largest == pytest.approx(ddp_largest, rel=1e-5), f"stage {stage}"
            assert write is not None
            assert "would write a parameter's `.grad`" in write
            assert "HINT" in write
            # After backward .grad holds no partial (shard-filled) gradient: Lightning's grad_norm finds none.
            assert all(n == {} for n in after_backward), f"stage {stage}: .grad is partial after backward"


def _phased_runs(root: str) -> dict[str, Any]:
    """The refusal's HINT: one fit per phase, ``requires_grad`` set before each, a new Trainer each time. At stage 3
    the second Trainer cannot take the model over (its buckets were laid out with the backbone frozen: Note [a model
    sharded by an earlier Trainer]), so it is refused before training, and the weights go to a fresh model as the
    refusal's HINT says."""
    out: dict[str, Any] = {}
    for name, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
        module = WithBackbone(record=False)
        previous: pl.Trainer | None = None
        for trainable in (False, True):
            module.backbone.requires_grad_(trainable)
            strategy = ZeroStrategy(stage=stage) if stage else "ddp_find_unused_parameters_true"
            trainer = _trainer(strategy, [], root)
            try:
                trainer.fit(module)
            except ValueError as error:
                out["refusal"] = (str(error), module.steps)
                assert previous is not None
                fresh = WithBackbone(record=False)
                with previous.strategy.full_state_dict():
                    fresh.load_state_dict(module.state_dict())
                fresh.backbone.requires_grad_(trainable)
                module = fresh
                trainer = _trainer(ZeroStrategy(stage=stage), [], root)
                trainer.fit(module)
            previous = trainer
        assert previous is not None
        with previous.strategy.full_state_dict() if stage == 3 else contextlib.nullcontext():
            out[name] = {k: v.cpu() for k, v in module.state_dict().items()}
    return out


@pytest.mark.timeout(120)
def test_fine_tuning_in_phases_gives_ddps_weights_and_a_stage_3_model_whose_trainable_set_changed_is_refused():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_phased_runs, 2, root, init_process_group=False, timeout=110)
    for rank in results:
        initial = _weights(WithBackbone(record=False))
        assert not torch.allclose(rank["ddp"]["backbone.0.weight"], initial["backbone.0.weight"]), "phase 2 trained"
        for stage in ("zero1", "zero2", "zero3"):
            for k, expected in rank["ddp"].items():
                torch.testing.assert_close(rank[stage][k], expected, rtol=1e-5, atol=1e-6, msg=f"{stage} {k}")
        message, steps = rank["refusal"]
        assert "requires_grad" in message, message
        assert "'backbone.0.weight'" in message
        assert "HINT" in message
        assert steps == STEPS_PER_EPOCH, "the first fit ran; the second was refused before its first step"


def _accumulating_runs(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    strategies: list[tuple[str, Any]] = [("ddp", "ddp_find_unused_parameters_true")]
    strategies += [
        ("zero1", ZeroStrategy(stage=1, bucket_numel=100)),
        ("zero1_no_overlap", ZeroStrategy(stage=1, bucket_numel=100, overlap_comm=False)),
    ]
    strategies += [("zero3", ZeroStrategy(stage=3, bucket_numel=100))]
    for name, strategy in strategies:
        module = Net()
        trainer = _trainer(strategy, [], root, epochs=2)
        trainer.accumulate_grad_batches = 2
        trainer.fit(module)
        out[name] = (module.norms, module.lightning_norms, {k: v.cpu() for k, v in weights(module).items()})
    return out


@pytest.mark.timeout(120)
def test_grad_norm_and_weights_match_ddp_with_gradient_accumulation():
    """Stage 1's hidden ``.grad`` (Note [no partial gradients]) under accumulation, with and without overlap_comm:
    the micro-batches still add up to DDP's gradients."""
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_accumulating_runs, 2, root, init_process_group=False, timeout=110)
    for rank in results:
        ddp_norms, _, ddp_weights = rank["ddp"]
        assert len(ddp_norms) == 4  # 2 epochs of 3 batches: steps after batches 2 and 3
        for name in ("zero1", "zero1_no_overlap", "zero3"):
            norms, lightning_norms, final = rank[name]
            assert len(norms) == len(lightning_norms) == len(ddp_norms)
            for step, lightnings, expected in zip(norms, lightning_norms, ddp_norms, strict=True):
                assert step == pytest.approx(expected, rel=1e-5), name
                assert lightnings == pytest.approx(expected, rel=1e-5), name  # .grad: the accumulated average
            for k, expected in ddp_weights.items():
                torch.testing.assert_close(final[k], expected, rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
