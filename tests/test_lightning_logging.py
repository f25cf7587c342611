"""Metrics, logging and the collectives Lightning asks of a strategy: the same values under ZeRO as under DDP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_zero import ZeroStrategy
from tests.harness import run_distributed
from tests.parity import loss_fn
from tests.test_lightning_features import STEPS, ZERO_RUNS, LitMLP, MemoryLogger, loader, make_trainer, zero


class LitMetrics(LitMLP):
    """Logs a torchmetrics metric updated in ``validation_step`` and values synchronized with ``sync_dist``."""

    def __init__(self) -> None:
        super().__init__()
        self.val_mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_loss_sum", loss, sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_mse(self.model(x), y)
        self.log("val_mse", self.val_mse)
        self.log("val_loss", loss_fn("mlp", self.model, batch), sync_dist=True)
        self.log("val_loss_max", loss_fn("mlp", self.model, batch), sync_dist=True, reduce_fx="max")


def _collectives(strategy: Strategy) -> dict[str, Any]:
    """Every collective Lightning calls on a strategy, with rank-dependent inputs."""
    rank = strategy.global_rank
    t = torch.tensor([1.0 + rank, 10.0 * rank])
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    gathered = strategy.all_gather(x, sync_grads=True)
    (gathered * torch.tensor([[1.0], [3.0]])).sum().backward()  # gradients flow back to each rank's input
    strategy.barrier("probe")
    return {
        "mean": strategy.reduce(t.clone(), reduce_op="mean"),
        "avg": strategy.reduce(t.clone(), reduce_op="avg"),
        "sum": strategy.reduce(t.clone(), reduce_op="sum"),
        "sum_op": strategy.reduce(t.clone(), reduce_op=ReduceOp.SUM),
        "max_op": strategy.reduce(t.clone(), reduce_op=ReduceOp.MAX),
        "not_a_tensor": strategy.reduce(3.5),
        "all_gather": strategy.all_gather(t),
        "all_gather_scalar": strategy.all_gather(torch.tensor(float(rank))),
        "all_gather_grad": x.grad,
        "broadcast": strategy.broadcast({"from": rank, "t": t}, src=1),
        "decision_all": strategy.reduce_boolean_decision(rank == 0, all=True),
        "decision_any": strategy.reduce_boolean_decision(rank == 0, all=False),
    }


def _metrics_runs() -> dict[str, dict]:
    runs = {}
    for name, strategy in {"ddp": "ddp", "zero1": zero(1), "zero2": zero(2), "zero3": zero(3)}.items():
        module = LitMetrics()
        logger = MemoryLogger()
        trainer = make_trainer(
            strategy, max_steps=-1, max_epochs=2, limit_train_batches=STEPS // 2, logger=logger, log_every_n_steps=1
        )
        trainer.fit(module, loader(2 * 4 * STEPS), loader(2 * 4 * 3))
        validated = trainer.validate(module, loader(2 * 4 * 3), verbose=False)
        runs[name] = {
            "logged": logger.history,
            "callback_metrics": {k: v.item() for k, v in trainer.callback_metrics.items()},
            "validated": validated,
            "collectives": _collectives(trainer.strategy),
        }
    return runs


@pytest.fixture(scope="module")
def metrics_runs() -> list[dict[str, dict]]:
    return run_distributed(_metrics_runs, 2, init_process_group=False, timeout=180)


@pytest.mark.timeout(240)
def test_torchmetrics_and_sync_dist_logging_match_ddp_under_every_stage(metrics_runs):
    for runs in metrics_runs:
        reference = runs["ddp"]
        keys = {k for _, metrics in reference["logged"] for k in metrics}
        assert {"train_loss", "train_loss_sum", "val_mse", "val_loss", "val_loss_max"} <= keys
        for name in ZERO_RUNS:
            got = runs[name]
            assert [s for s, _ in got["logged"]] == [s for s, _ in reference["logged"]], name
            for (_, expected), (_, actual) in zip(reference["logged"], got["logged"], strict=True):
                assert actual.keys() == expected.keys(), name
                for key, value in expected.items():
                    assert actual[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, key)
            assert got["callback_metrics"] == pytest.approx(reference["callback_metrics"], rel=1e-5), name
            assert got["validated"][0] == pytest.approx(reference["validated"][0], rel=1e-5), name


def _assert_same(expected: Any, actual: Any, path: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        assert actual.keys() == expected.keys(), path
        for key in expected:
            _assert_same(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), path
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=path)
    else:
        assert type(actual) is type(expected), path
        assert actual == expected, path


@pytest.mark.timeout(240)
def test_reduce_all_gather_broadcast_and_barrier_behave_as_under_ddp(metrics_runs):
    for rank, runs in enumerate(metrics_runs):
        reference = runs["ddp"]["collectives"]
        # Spot-check the reference itself, so that a DDP change cannot make both sides wrong alike.
        torch.testing.assert_close(reference["mean"], torch.tensor([1.5, 5.0]))
        torch.testing.assert_close(reference["sum"], torch.tensor([3.0, 10.0]))
        torch.testing.assert_close(reference["all_gather_grad"], torch.tensor([1.0 + 2.0 * rank]) * 2)
        assert reference["broadcast"]["from"] == 1
        assert reference["decision_all"] is False
        assert reference["decision_any"] is True
        for name in ZERO_RUNS:
            _assert_same(reference, runs[name]["collectives"], name)


def test_zero_strategy_is_a_strategy_lightning_can_query_without_a_process_group():
    strategy = ZeroStrategy(stage=2)
    # Before `setup_environment` (e.g. a Trainer built for inspection), collectives are identities as for DDP.
    assert strategy.reduce(torch.tensor(2.0)) == torch.tensor(2.0)
    assert strategy.broadcast("x") == "x"
    strategy.barrier()
