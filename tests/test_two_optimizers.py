"""Two optimizers stepping after one backward (manual optimization: a GAN's generator and discriminator, a body and
a head with their own learning rates) give DDP's numbers at every stage, in every precision, with and without
memory tiers and gradient clipping, in every order users write the steps and ``zero_grad`` calls.

At stage 3 both optimizers' ``ZeroOptimizer`` share the model's one gradient reducer, and a unit may hold
parameters of both (here the root unit does): each optimizer must consume and clear only its own gradients (Note
[gradients of several optimizers] in ``sharding/gradient_owners.py``).
"""

from __future__ import annotations

import tempfile
import traceback
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import DynamicLossScaler, ZeroConfig, ZeroOptimizer, ZeroPrecision, ZeroStrategy, shard_module
from lightning_zero.models.mlp import MLP
from tests import test_mixed_precision as mixed
from tests.harness import run_distributed
from tests.offload_runs import forced_host_copies
from tests.test_lightning_features import STEPS, full_weights, loader, make_trainer

BATCHES = 8
"""Per rank: two rounds of the four step patterns of ``TwoOptimizers.training_step``."""
SCALE = 2.0**8
"""fp16's loss scale, on both sides; it never grows or backs off in these runs (no overflow, a huge interval)."""
EXACT = 1e-5
MIXED = 2e-2
"""Against DDP in a mixed precision: ZeRO keeps low-precision parameters, DDP fp32 ones (``test_mixed_precision``)."""
DISK = {"offload_dir": "offload"}
ROOT_ONLY = {"wrap_module_classes": ()}
"""Stage 3 with one unit, the root: both optimizers' parameters in one gradient bucket."""
VARIANTS: dict[str, dict[str, Any]] = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3, **ROOT_ONLY},
    "stage3_units": {"stage": 3},
    "stage2_cpu_copies": {"stage": 2, "offload_optimizer": "cpu", "copies": True},
    "stage3_cpu_copies": {"stage": 3, "offload_optimizer": "cpu", "copies": True, **ROOT_ONLY},
    "stage3_disk": {"stage": 3, "offload_optimizer": "disk", **DISK, **ROOT_ONLY},
}


class TwoOptimizers(pl.LightningModule):
    """A body and a head optimizer after one ``manual_backward``, the steps in a different order each batch:

    0. clip both (the body by norm, the head by value), step a then b, zero both;
    1. step b then a, zero both;
    2. a steps and zeroes before b steps and zeroes;
    3. only a steps: b accumulates this backward with the next one.

    ``clip_factor`` multiplies the clip thresholds: DDP's fp16 clips its still-scaled gradients in a manual step.
    """

    def __init__(self, clip_factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.model = MLP(in_features=12, hidden=(32, 24), out_features=5)
        self.automatic_optimization = False
        self.clip_factor = clip_factor
        self.losses: list[float] = []

    def configure_optimizers(self) -> Any:
        body, head = self.model.net[:-1], self.model.net[-1]
        return [
            torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9),
            torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.1),
        ]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        a, b = self.optimizers()  # type: ignore[misc]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss)
        pattern = batch_idx % 4
        if pattern == 0:
            self.clip_gradients(a, gradient_clip_val=0.05 * self.clip_factor, gradient_clip_algorithm="norm")
            self.clip_gradients(b, gradient_clip_val=0.02 * self.clip_factor, gradient_clip_algorithm="value")
            a.step()
            b.step()
            a.zero_grad()
            b.zero_grad()
        elif pattern == 1:
            b.step()
            a.step()
            b.zero_grad()
            a.zero_grad()
        elif pattern == 2:
            a.step()
            a.zero_grad()
            b.step()
            b.zero_grad()
        else:
            a.step()
            a.zero_grad()


def _precision(ddp: bool, precision: str) -> dict[str, Any]:
    if precision != "16-mixed":
        return {"precision": precision}
    if ddp:
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
        return {"precision": None, "plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
    scaler = DynamicLossScaler(scale=SCALE, growth_interval=10**6)
    return {"precision": None, "plugins": [ZeroPrecision("16-mixed", loss_scaler=scaler)]}


def _train(root: str, variant: dict[str, Any] | None, precision: str) -> dict[str, Any]:
    """One run under DDP (``variant`` None) or ``ZeroStrategy(**variant)``: losses, full weights, and whether
    some gradient bucket holds parameters of both optimizers. An exception comes back as text."""
    ddp = variant is None
    copies = not ddp and bool(variant.pop("copies", False))
    module = TwoOptimizers(SCALE if ddp and precision == "16-mixed" else 1.0)
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(2 * BATCHES * 4, 12, generator=generator), torch.randn(2 * BATCHES * 4, 5))
    trainer = pl.Trainer(
        strategy="ddp" if ddp else ZeroStrategy(**variant),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **_precision(ddp, precision),
    )
    try:
        with forced_host_copies() if copies else nullcontext():
            trainer.fit(module, DataLoader(data, batch_size=4))
    except Exception as error:  # reported with the variant's name, without hiding the other variants
        return {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    shared = False
    if not ddp:
        zero = [opt for opt in trainer.optimizers if isinstance(opt, ZeroOptimizer)]
        owned = [{id(b) for b in opt.buckets} for opt in zero]
        shared = bool(owned[0] & owned[1])
        context: Any = trainer.strategy.gathered_parameters()  # type: ignore[attr-defined]
    else:
        context = nullcontext()
    with context:
        weights = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    return {"losses": module.losses, "weights": weights, "shared": shared}


def _runs(root: str, precision: str, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    runs = {"ddp": _train(root, None, precision)}
    for label, variant in variants.items():
        runs[label] = _train(root, dict(variant), precision)
    return runs


def _mismatch(run: dict[str, Any], reference: dict[str, Any], tolerance: float) -> str | None:
    """Why ``run`` is not ``reference`` (losses, then weights), or None."""
    if "error" in run:
        return str(run["trace"])
    if len(run["losses"]) != BATCHES:
        return f"{len(run['losses'])} losses"
    try:
        torch.testing.assert_close(
            torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=tolerance, atol=0
        )
        for name, value in reference["weights"].items():
            torch.testing.assert_close(run["weights"][name], value, rtol=tolerance, atol=tolerance * 1e-1, msg=name)
    except AssertionError as error:
        return " ".join(str(error).split())[:300]
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_two_optimizers_after_one_backward_step_as_ddp_in_every_order_stage_precision_and_tier(precision):
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(_runs, 2, root, precision, VARIANTS, init_process_group=False, timeout=110)
    tolerance = EXACT if precision == "32-true" else MIXED
    for runs in ranks:
        assert runs["stage3"]["shared"]  # the case that needs each optimizer to take only its own gradients
        assert not runs["stage2"]["shared"]
        assert not runs["stage3_units"]["shared"]
        against_ddp = {label: _mismatch(runs[label], runs["ddp"], tolerance) for label in VARIANTS}
        # A tier moves bytes; it changes no number.
        tiered = ("stage2_cpu_copies", "stage3_cpu_copies", "stage3_disk")
        against_zero = {label: _mismatch(runs[label], runs[label.split("_")[0]], EXACT) for label in tiered}
        wrong = {f"{k} against DDP": v for k, v in against_ddp.items() if v}
        wrong |= {f"{k} against ZeRO without tiers": v for k, v in against_zero.items() if v}
        assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())


OVERFLOW_VARIANTS: dict[str, dict[str, Any]] = {
    "stage2": {"stage": 2},
    "stage3": {"stage": 3, **ROOT_ONLY},
    "stage3_cpu_copies": {"stage": 3, "offload_optimizer": "cpu", "copies": True, **ROOT_ONLY},
    "stage3_disk": {"stage": 3, "offload_optimizer": "disk", **DISK, **ROOT_ONLY},
}


def _overflow_runs(root: str) -> dict[str, Any]:
    """16-mixed, ``test_mixed_precision.LitTwoOptimizers``: the head's gradient overflows once on rank 1. Each
    variant's loss scales after every batch and final weights."""
    runs = {}
    for label, variant in OVERFLOW_VARIANTS.items():
        kwargs = dict(variant)
        copies = bool(kwargs.pop("copies", False))
        module = mixed.LitTwoOptimizers()
        precision = ZeroPrecision(
            "16-mixed", loss_scaler=DynamicLossScaler(scale=2.0**6, growth_interval=mixed.GROWTH_INTERVAL)
        )
        trainer = make_trainer(ZeroStrategy(**kwargs), plugins=[precision], max_steps=2 * STEPS, default_root_dir=root)
        with forced_host_copies() if copies else nullcontext():
            trainer.fit(module, loader(2 * 4 * STEPS))
        runs[label] = {"scales": module.scales, "weights": full_weights(trainer, module)}
    return runs


@pytest.mark.timeout(120)
def test_each_optimizers_loss_scale_follows_its_own_overflows_when_they_share_a_bucket_and_a_tier():
    """The body's scale grows undisturbed while the head's backs off at its overflow, as each would alone, with
    both optimizers' parameters in one stage-3 bucket, in memory, in the host tier and on disk."""
    body, head = mixed._alone(set()), mixed._alone({mixed.OVERFLOW_STEP})
    assert body != head
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(_overflow_runs, 2, root, init_process_group=False, timeout=110)
    for runs in ranks:
        for label, run in runs.items():
            assert [s[0] for s in run["scales"]] == body, label
            assert [s[1] for s in run["scales"]] == head, label
            for name, value in runs["stage2"]["weights"].items():
                assert torch.isfinite(run["weights"][name]).all(), (label, name)
                torch.testing.assert_close(run["weights"][name], value, rtol=EXACT, atol=EXACT, msg=label)


def _zero_grad_of_one_over_local_gradients() -> dict[str, str]:
    """Raw API, stage 3, one unit: a backward inside ``no_sync`` with local accumulation, then one optimizer's
    ``zero_grad``: what it raised."""
    group = dist.group.WORLD
    assert group is not None
    config = ZeroConfig(stage=3, grad_accumulation="local", **ROOT_ONLY)
    torch.manual_seed(0)
    model = MLP(in_features=12, hidden=(32, 24), out_features=5)
    gatherer = shard_module(model, config, group, torch.device("cpu"))
    body, head = model.net[:-1], model.net[-1]
    a = ZeroOptimizer(model, torch.optim.SGD(body.parameters(), lr=0.1), group, config, gatherer)
    b = ZeroOptimizer(model, torch.optim.SGD(head.parameters(), lr=0.1), group, config, gatherer)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(dist.get_rank()))
    with a.no_sync(), b.no_sync():
        model(x).square().mean().backward()
    outcome = {}
    try:
        a.zero_grad()
        outcome["local"] = "cleared"
    except RuntimeError as error:
        outcome["local"] = str(error)
    return outcome


def test_zero_grad_of_one_optimizer_over_unreduced_local_gradients_it_shares_a_bucket_with_is_refused():
    """Gradients accumulated locally (``grad_accumulation="local"`` inside ``no_sync``) are not yet split into
    shards: one optimizer's part cannot be cleared without the other's, so its ``zero_grad`` is refused."""
    for outcome in run_distributed(_zero_grad_of_one_over_local_gradients, 2, timeout=60):
        assert "HINT" in outcome["local"]
        assert "no_sync" in outcome["local"]
