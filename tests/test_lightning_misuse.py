"""Misuse where ZeRO would silently train differently from DDP: each is refused, or at least named, instead."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero import ZeroConfig, ZeroOptimizer
from tests.harness import run_distributed
from tests.parity import build_model
from tests.test_lightning_features import STEPS, ZERO_RUNS, LitMLP, assert_matches_ddp, fit, loader, make_trainer, zero


def _fit_error(strategy: Any, module: Any, **trainer_kwargs: Any) -> str:
    """The error ``fit`` raised on this rank ("" if it trained)."""
    try:
        make_trainer(strategy, **trainer_kwargs).fit(module, loader(2 * 4 * STEPS))
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


# -- clip values ---------------------------------------------------------------------------------------------------
class LitManualClip(LitMLP):
    def __init__(self, clip_val: float) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clip_val = clip_val

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        self.clip_gradients(optimizer, gradient_clip_val=self.clip_val, gradient_clip_algorithm="value")
        optimizer.step()


def _clip_value_errors() -> dict[str, Any]:
    errors = {
        "norm=-1": _fit_error(zero(2), LitMLP(), gradient_clip_val=-1.0),
        "value=-0.5": _fit_error(zero(1), LitMLP(), gradient_clip_val=-0.5, gradient_clip_algorithm="value"),
        "nan": _fit_error(zero(3), LitManualClip(float("nan"))),
        "manual=-1": _fit_error(zero(2), LitManualClip(-1.0)),
    }
    # 0 is Lightning's "no clipping" (once the Trainer default): it must train exactly as DDP does.
    disabled = [fit(strategy, LitMLP(), gradient_clip_val=0) for strategy in ("ddp", zero(2))]
    return {"errors": errors, "disabled": disabled}


@pytest.mark.timeout(180)
def test_negative_or_nan_clip_values_raise_naming_the_value_and_zero_disables_clipping_as_under_ddp():
    for result in run_distributed(_clip_value_errors, 2, init_process_group=False):
        for case, error in result["errors"].items():
            assert error.startswith("ValueError: Invalid gradient clip value"), (case, error)
            assert "HINT" in error, case
        assert "-1.0" in result["errors"]["norm=-1"]
        assert "nan" in result["errors"]["nan"]
        reference, sharded = result["disabled"]
        assert_matches_ddp(reference, sharded)


def _direct_clip_errors() -> list[str]:
    model = build_model("mlp")
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, ZeroConfig())
    errors = []
    for clip in (optimizer.clip_grad_norm_, optimizer.clip_grad_value_):
        for value in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match=r"Invalid gradient clip value .*HINT") as caught:
                clip(value)
            errors.append(str(caught.value))
    return errors


@pytest.mark.timeout(60)
def test_zero_optimizer_clipping_rejects_zero_negative_and_nan():
    # Called directly (without Lightning, which reads 0 as "off"), 0 would zero every gradient and NaN poison them.
    (errors,) = run_distributed(_direct_clip_errors, 1)
    assert len(errors) == 6


# -- gradient clipping that bypasses the strategy --------------------------------------------------------------------
class LitTorchClip(LitMLP):
    """Clips by calling torch on ``self.parameters()``: under ZeRO those hold no reduced gradients."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


class LitLightningClip(LitMLP):
    """Customizes clipping the supported way: through ``self.clip_gradients``."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.global_step >= 2:  # e.g. no clipping during warm-up
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def _custom_clipping() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in ("ddp", *ZERO_RUNS):
        for module in (LitTorchClip(), LitLightningClip()):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run = fit("ddp" if name == "ddp" else zero(int(name[-1])), module)
            run["warnings"] = [str(w.message) for w in caught if "configure_gradient_clipping" in str(w.message)]
            results[f"{type(module).__name__}/{name}"] = run
    return results


@pytest.mark.timeout(180)
def test_configure_gradient_clipping_that_bypasses_the_strategy_is_named_and_the_supported_way_matches_ddp():
    ranks = run_distributed(_custom_clipping, 2, init_process_group=False)
    for rank, runs in enumerate(ranks):
        for name in ZERO_RUNS:
            # torch's clip_grad_norm_ finds no gradients on the parameters and clips nothing: named, once, on rank 0.
            warned = runs[f"LitTorchClip/{name}"]["warnings"]
            assert len(warned) == (1 if rank == 0 else 0), (name, warned)
            if warned:
                assert "self.clip_gradients(" in warned[0]
                assert "HINT" in warned[0]
            # Through self.clip_gradients, even skipped on some steps: no warning, and DDP's training.
            assert runs[f"LitLightningClip/{name}"]["warnings"] == [], name
            assert_matches_ddp(runs["LitLightningClip/ddp"], runs[f"LitLightningClip/{name}"], label=name)
        assert runs["LitTorchClip/ddp"]["warnings"] == []


# -- requires_grad changed after the optimizer was sharded -------------------------------------------------------------
class LitFreezeLater(LitMLP):
    """Freezes (or unfreezes) the first layer after setup, as a hand-written fine-tuning schedule might."""

    def __init__(self, unfreeze: bool) -> None:
        super().__init__()
        self.unfreeze = unfreeze
        if unfreeze:
            self.model.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            self.model.net[0].requires_grad_(self.unfreeze)


def _freeze_later() -> dict[str, str]:
    return {
        f"{name}/{'unfreeze' if unfreeze else 'freeze'}": _fit_error(zero(int(name[-1])), LitFreezeLater(unfreeze))
        for name in ZERO_RUNS
        for unfreeze in (False, True)
    }


@pytest.mark.timeout(180)
def test_changing_requires_grad_after_setup_raises_naming_the_parameter():
    for errors in run_distributed(_freeze_later, 2, init_process_group=False):
        for case, error in errors.items():
            assert "'model.net.0." in error, (case, error)
            became = "frozen" if case.endswith("/freeze") else "trainable"
            assert f"is {became} now" in error, (case, error)
            assert "HINT" in error, case


# -- two optimizers under automatic optimization ---------------------------------------------------------------------
class LitTwoOptimizers(LitMLP):
    def configure_optimizers(self) -> Any:
        head, body = self.model.net[-1], self.model.net[:-1]
        return [torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]


def _two_optimizer_errors() -> list[str]:
    return [_fit_error(strategy, LitTwoOptimizers()) for strategy in ("ddp", zero(3))]


@pytest.mark.timeout(60)
def test_two_optimizers_under_automatic_optimization_are_refused_as_under_ddp():
    for ddp, sharded in run_distributed(_two_optimizer_errors, 2, init_process_group=False):
        assert "manual optimization" in ddp
        assert sharded == ddp
