"""Stage 3 survives Lightning's teardown: ``fit``, ``validate``, ``fit`` again on one module, still sharded on its
device (Note [teardown keeps the model sharded]), and the same losses and weights as DDP doing the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroStrategy
from tests.harness import run_distributed
from tests.parity import loss_fn
from tests.test_strategy import STEPS, ConfigureModelModule, _dataset, _full_weights, _trainer, assert_fits_match


class TrackedModule(ConfigureModelModule):
    """Counts module-wide tensor moves (``.cpu()``, ``.to()``) after a run ends; has a buffer and validates."""

    def __init__(self) -> None:
        super().__init__("gpt", "adamw")
        self.moves_after_run = 0
        self.run_over = False
        self.register_buffer("seen", torch.zeros(()))
        self.val_losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_losses.append(loss_fn("gpt", self.model, batch).item())

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.moves_after_run += self.run_over
        return super()._apply(fn, recurse)

    def on_fit_end(self) -> None:
        self.run_over = True  # teardown comes next

    def on_validation_end(self) -> None:
        self.run_over = True


def _sharded_state(module: TrackedModule, strategy: Any) -> dict[str, Any]:
    """Every parameter outside a persistent bucket holds at most one element; persistent ones and the buffer are
    still views of the storage the strategy knows."""
    gatherer = getattr(strategy, "_gatherer", None)
    if gatherer is None:
        return {}
    full = [n for n, p in module.named_parameters() if p.untyped_storage().nbytes() > p.element_size()]
    resident = {id(p): b for b in gatherer.resident_buckets for p in b.params}
    detached = [
        n
        for n, p in module.named_parameters()
        if id(p) in resident and p.untyped_storage().data_ptr() != resident[id(p)].data.untyped_storage().data_ptr()
    ]
    persistent = {n for n, p in module.named_parameters() if id(p) in resident}
    return {"full": sorted(set(full) - persistent), "detached": detached, "persistent": len(persistent)}


def _fit_validate_fit(strategy: Any) -> dict[str, Any]:
    module = TrackedModule()
    loader = DataLoader(_dataset("gpt", 2 * 4 * 2 * STEPS), batch_size=4)
    trainer = _trainer(strategy)
    states = []
    trainer.fit(module, loader)
    buffer = module.seen
    states.append(_sharded_state(module, trainer.strategy))
    trainer.validate(module, DataLoader(_dataset("gpt", 16), batch_size=4), verbose=False)
    states.append(_sharded_state(module, trainer.strategy))
    module.run_over = False
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(module, loader)
    states.append(_sharded_state(module, trainer.strategy))
    return {
        "losses": module.losses,
        "lrs": module.lrs,
        "val_losses": module.val_losses,
        "weights": _full_weights(trainer, module.model),
        "states": states,
        "moves_after_run": module.moves_after_run,
        "seen": module.seen.item(),
        "same_buffer": module.seen is buffer,
    }


def _ddp_then_zero3() -> list[dict[str, Any]]:
    return [_fit_validate_fit("ddp"), _fit_validate_fit(ZeroStrategy(stage=3, persistence_threshold=100))]


@pytest.mark.timeout(180)
def test_zero3_fit_validate_fit_keeps_the_model_sharded_and_matches_ddp():
    for reference, sharded in run_distributed(_ddp_then_zero3, 2, init_process_group=False):
        assert len(sharded["losses"]) == 2 * STEPS
        assert_fits_match(reference, sharded)
        torch.testing.assert_close(sharded["val_losses"], reference["val_losses"], rtol=1e-5, atol=1e-6)
        assert sharded["moves_after_run"] == 0  # teardown moved nothing (DDP's moved the model to the CPU)
        assert reference["moves_after_run"] > 0
        for state in sharded["states"]:
            assert state["full"] == [], state  # no full-size parameter storage after any run
            assert state["detached"] == [], state
            assert state["persistent"] > 0  # layer norms: the persistent path was exercised
        assert sharded["same_buffer"]
        assert sharded["seen"] == reference["seen"] == 2 * STEPS
