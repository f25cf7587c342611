"""Precision through the Trainer: bf16 parity with DDP, fp16 loss scaling agreed by every rank, the paper's memory
formula per rank, and clear errors for precisions ZeRO does not support."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from torch import Tensor

from lightning_zero import (
    DynamicLossScaler,
    ZeroConfig,
    ZeroOptimizer,
    ZeroPrecision,
    ZeroStrategy,
    expected_model_state_bytes,
)
from lightning_zero.trainer.precision import to_zero_precision
from tests.harness import run_distributed
from tests.parity import batch, build_model
from tests.test_lightning_features import (
    STEPS,
    ZERO_RUNS,
    LitMLP,
    fit,
    make_trainer,
    zero,
)
from tests.test_strategy import ParityModule, _dataset

# -- bf16: the same training as DDP's, within bf16 rounding ----------------------------------------------------------
# Under DDP, bf16-mixed keeps fp32 parameters and autocasts the matmuls; ZeRO stores the parameters (and so the
# gradients and their reduction) in bf16, with fp32 masters. The matmuls see the same bf16 weights either way, but
# LayerNorm weights, gradients and the reductions round differently, so the runs agree to bf16 precision, not bit
# for bit. bf16 keeps 8 significant bits: one unit in the last place (ulp) is 2^-8 of the value. Over 8 steps:
#  - losses: rtol 2^-7 (two ulps). Measured: at most 3.2e-3 on every stage, with or without accumulation.
#  - weights, compared with DDP's rounded to bf16 (what ZeRO stores): rtol 2^-7 (one ulp for the final rounding,
#    one for the gradients' rounding carried into the update), plus an atol for elements near zero, where the
#    rounding of the gradient matters, not of the weight: STEPS * lr * 2^-8 = 1.6e-3 for SGD at lr 0.05 with
#    gradients below 1. Measured: at most 6.1e-4 above the rtol.
#  - bf16-true has no fp32 anywhere on either side: every update is rounded to bf16, and the clip coefficient is
#    computed in bf16 by torch (DDP) but from an fp64 norm by ZeRO, so the runs drift apart by about an ulp per step.
#    Losses: rtol 2^-6 (measured 7.5e-3); weights: the bounds above (measured at most 1.4e-5 above the rtol).
# SGD, not Adam: Adam divides by the gradient's own magnitude, so bf16 noise on a near-zero gradient flips a full
# lr-sized step, and the bound becomes steps * lr whatever the implementation.
BF16_LOSS_RTOL = {"bf16-mixed": 2**-7, "bf16-true": 2**-6}
BF16_WEIGHT_RTOL = 2**-7
BF16_WEIGHT_ATOL = STEPS * 0.05 * 2**-8
ACCUMULATE_SAMPLES = 2 * 4 * 3 * STEPS


def _bf16_runs() -> dict[str, dict]:
    runs: dict[str, dict] = {}
    for name, make in {
        "ddp": lambda: "ddp",
        "zero1": lambda: zero(1),
        "zero2": lambda: zero(2),
        "zero3": lambda: zero(3),
    }.items():
        runs[f"clip/{name}"] = fit(make(), LitMLP(), precision="bf16-mixed", gradient_clip_val=0.05)
        runs[f"accumulate/{name}"] = fit(
            make(), LitMLP(), samples=ACCUMULATE_SAMPLES, precision="bf16-mixed", accumulate_grad_batches=3
        )
        runs[f"true/{name}"] = fit(make(), LitMLP(), precision="bf16-true", gradient_clip_val=0.05)
    runs["accumulate/zero2_local"] = fit(
        zero(2, grad_accumulation="local"),
        LitMLP(),
        samples=ACCUMULATE_SAMPLES,
        precision="bf16-mixed",
        accumulate_grad_batches=3,
    )
    return runs


@pytest.mark.timeout(240)
def test_bf16_matches_ddp_bf16_within_bf16_rounding_under_every_stage():
    for runs in run_distributed(_bf16_runs, 2, init_process_group=False, timeout=180):
        for feature in ("clip", "accumulate", "true"):
            reference = runs[f"{feature}/ddp"]
            loss_rtol = BF16_LOSS_RTOL["bf16-true" if feature == "true" else "bf16-mixed"]
            rounded = {n: w.bfloat16().float() for n, w in reference["weights"].items()}
            names = [*ZERO_RUNS, "zero2_local"] if feature == "accumulate" else ZERO_RUNS
            for name in names:
                run = runs[f"{feature}/{name}"]
                torch.testing.assert_close(
                    torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=loss_rtol, atol=0
                )
                assert run["lrs"] == reference["lrs"]
                for fqn, expected in rounded.items():
                    torch.testing.assert_close(
                        run["weights"][fqn], expected, rtol=BF16_WEIGHT_RTOL, atol=BF16_WEIGHT_ATOL, msg=fqn
                    )


def _clip_norm_of_bf16_gradients(stage: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = build_model("mlp").to(torch.bfloat16)
    reference = copy.deepcopy(model)
    optimizer = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dist.group.WORLD,
        ZeroConfig(stage=stage, bucket_numel=300),
        fp32_masters=False,
    )
    x, y = (t.to(torch.bfloat16) for t in batch("mlp", 0, 0, 0))  # the same batch on every rank: mean = local
    for module in (model, reference):
        torch.nn.functional.mse_loss(module(x), y).backward()
    exact = torch.cat([p.grad.double().flatten() for p in reference.parameters()]).norm().item()
    return optimizer.clip_grad_norm_(1e9).item(), exact


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm_of_bf16_gradients_is_accumulated_in_fp32(stage):
    # bf16-true: the gradients (and the masters) are bf16. Per-shard bf16 norms would be off by up to 2^-9 each.
    for total, exact in run_distributed(_clip_norm_of_bf16_gradients, 2, stage):
        assert total == pytest.approx(exact, rel=1e-6)


# -- 16-mixed: an overflow on one rank is skipped by all ------------------------------------------------------------
OVERFLOW_STEP = 3
INITIAL_SCALE = 2.0**10  # low enough that the tiny model's fp16 gradients never overflow by themselves


class LitOverflow(LitMLP):
    """Makes one gradient element inf on rank 1 only, at one step, and records what every rank saw."""

    def __init__(self) -> None:
        super().__init__()
        self.saw_inf: list[bool] = []
        self.scales: list[float] = []
        self.shards: list[Tensor] = []

    def on_fit_start(self) -> None:
        def poison(grad: Tensor) -> Tensor:
            if self.global_rank == 1 and self.global_step == OVERFLOW_STEP:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        self.model.net[3].weight.register_hook(poison)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # The reduced, unscaled gradient shards of this rank: only the rank owning the poisoned element sees it.
        masters = _zero_optimizer(self.trainer).masters
        self.saw_inf.append(any(not torch.isfinite(m.grad).all() for m in masters if m.grad is not None))

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        precision = self.trainer.precision_plugin
        assert isinstance(precision, ZeroPrecision)
        assert precision.loss_scaler is not None
        self.scales.append(precision.loss_scaler.scale)
        self.shards.append(torch.cat([m.detach().flatten() for m in _zero_optimizer(self.trainer).masters]))


def _zero_optimizer(trainer: pl.Trainer) -> ZeroOptimizer:
    optimizer = trainer.strategy.optimizers[0]
    assert isinstance(optimizer, ZeroOptimizer)
    return optimizer


def _fp16_overflow() -> dict[str, dict]:
    runs = {}
    for name in ZERO_RUNS:
        module = LitOverflow()
        precision = ZeroPrecision("16-mixed", loss_scaler=DynamicLossScaler(scale=INITIAL_SCALE))
        # On CPU, Trainer(precision="16-mixed") becomes bf16-mixed before the strategy sees it: pass fp16 explicitly.
        # Clipping too: its norm all-reduce runs between the overflow check and the (skipped) step.
        trainer = make_trainer(zero(int(name[-1])), plugins=[precision], gradient_clip_val=1.0)
        trainer.fit(module, torch.utils.data.DataLoader(_dataset("mlp", 2 * 4 * STEPS), batch_size=4))
        with trainer.strategy.gathered_parameters():
            finite = all(torch.isfinite(p).all() for p in module.parameters())
        fresh = ZeroPrecision("16-mixed")
        fresh.load_state_dict(trainer.precision_plugin.state_dict())
        runs[name] = {
            "saw_inf": module.saw_inf,
            "scales": module.scales,
            "shards": module.shards,
            "finite": finite,
            "param_dtype": next(module.parameters()).dtype,
            "state_dict": trainer.precision_plugin.state_dict(),
            "reloaded_scale": fresh.loss_scaler.scale if fresh.loss_scaler is not None else None,
        }
    return runs


@pytest.mark.timeout(240)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_and_halves_every_scale():
    ranks = run_distributed(_fp16_overflow, 2, init_process_group=False, timeout=180)
    for name in ZERO_RUNS:
        per_rank = [runs[name] for runs in ranks]
        assert all(run["param_dtype"] == torch.float16 for run in per_rank)
        # Exactly one rank's shard held the non-finite element, at that step only.
        seen = [[run["saw_inf"][step] for run in per_rank] for step in range(STEPS)]
        assert sum(seen[OVERFLOW_STEP]) == 1, (name, seen)
        assert not any(any(s) for step, s in enumerate(seen) if step != OVERFLOW_STEP), (name, seen)
        for run in per_rank:
            expected = [INITIAL_SCALE] * OVERFLOW_STEP + [INITIAL_SCALE / 2] * (STEPS - OVERFLOW_STEP)
            assert run["scales"] == expected, name
            shards = run["shards"]
            for step in range(1, STEPS):
                unchanged = torch.equal(shards[step], shards[step - 1])
                assert unchanged == (step == OVERFLOW_STEP), (name, step)
            assert run["finite"], name
            # The scaler's state is part of the precision plugin's, so Lightning checkpoints and restores it.
            assert run["state_dict"] == {"loss_scaler": {"scale": INITIAL_SCALE / 2, "good_steps": 4}}, name
            assert run["reloaded_scale"] == INITIAL_SCALE / 2


# -- memory: the paper's per-rank bytes, measured through the Trainer -------------------------------------------------
def _model_state(stage: int, world_size: int) -> tuple[int, Any, int]:
    module = ParityModule("gpt", "adamw")
    strategy = ZeroStrategy(stage=stage, bucket_numel=4_000)
    trainer = make_trainer(strategy, devices=world_size, max_steps=2, precision="bf16-mixed")
    trainer.fit(module, torch.utils.data.DataLoader(_dataset("gpt", 64), batch_size=4))
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    gatherer = strategy._gatherer
    buckets = (
        [b for u in gatherer.units for b in u.buckets] + gatherer.resident_buckets
        if gatherer is not None
        else [b for o in strategy.optimizers if isinstance(o, ZeroOptimizer) for b in o.buckets]
    )
    padding = sum(b.padded_numel - b.numel for b in buckets)
    return sum(p.numel() for p in module.parameters()), strategy.model_state_bytes(), padding


def _model_state_per_stage(world_size: int) -> list[tuple[int, Any, int]]:
    return [_model_state(stage, world_size) for stage in (1, 2, 3)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world_size",
    # 4 s; [2] runs by default, and at 4 ranks test_memory_and_comm.py's bf16 formula test (stages 1 and 2) and
    # test_stage3.py's 16Ψ/N test.
    [2, pytest.param(4, marks=pytest.mark.slow)],
)
def test_bf16_mixed_model_state_per_rank_matches_the_paper_through_the_trainer(world_size):
    """4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N bytes per rank for bf16 parameters with fp32 masters and AdamW."""
    ranks = run_distributed(_model_state_per_stage, world_size, world_size, init_process_group=False, timeout=200)
    for per_stage in ranks:
        for stage, (num_params, measured, padding) in zip((1, 2, 3), per_stage, strict=True):
            expected = expected_model_state_bytes(num_params, world_size, stage)
            paper = {1: 4 * num_params + 12 * num_params / world_size, 2: 2 * num_params + 14 * num_params / world_size}
            assert expected.total == pytest.approx(paper.get(stage, 16 * num_params / world_size), abs=16)
            # Padding adds fewer than N elements per bucket, at most 16 bytes each (2 + 2 + 4 + 8): above the formula
            # on ranks that store it, below on the last rank, whose shard of each bucket ends in it.
            slack = 16 * padding
            for field in measured._fields:
                got, want = getattr(measured, field), getattr(expected, field)
                assert want - slack <= got <= want + slack, f"stage {stage} {field}: {got} B, formula {want} B"


# -- precisions ZeRO does not support ----------------------------------------------------------------------------------
def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, logger=False, **{"strategy": "zero2", **kwargs})


@pytest.mark.parametrize(
    ("precision", "plugin"), [("64-true", "DoublePrecision"), ("16-true", "HalfPrecision"), ("64", "DoublePrecision")]
)
def test_unsupported_precision_string_names_the_plugin_and_the_fix(precision, plugin):
    with pytest.raises(ValueError, match=rf"does not support the precision plugin {plugin}.*HINT: use Trainer\(prec"):
        _trainer(precision=precision)


def test_foreign_precision_plugin_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"FSDPPrecision \(precision='bf16-mixed'\).*HINT"):
        _trainer(plugins=[FSDPPrecision("bf16-mixed")])


def test_a_customized_lightning_precision_plugin_is_refused_rather_than_silently_replaced():
    class MyMixedPrecision(MixedPrecision):
        def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
            return super().pre_backward(tensor * 2, module)

    with pytest.raises(ValueError, match=r"MyMixedPrecision.*HINT: .*subclass lightning_zero.ZeroPrecision"):
        to_zero_precision(MyMixedPrecision("bf16-mixed", "cpu"))


def test_precision_plugin_given_to_the_strategy_is_kept():
    trainer = _trainer(strategy=ZeroStrategy(stage=2, precision_plugin=ZeroPrecision("16-mixed")))
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert trainer.precision_plugin.precision == "16-mixed"
    assert trainer.strategy.precision_plugin is trainer.precision_plugin


def test_grad_scaler_settings_of_a_lightning_plugin_become_the_loss_scaler():
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    precision = to_zero_precision(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert precision.loss_scaler == DynamicLossScaler(
        scale=128.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
    )


def test_zero_precision_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"Invalid precision for ZeroStrategy: '16-true'.*HINT"):
        ZeroPrecision("16-true")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"only used with precision='16-mixed'.*HINT"):
        ZeroPrecision("bf16-mixed", loss_scaler=DynamicLossScaler())
