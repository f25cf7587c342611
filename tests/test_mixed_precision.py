"""Mixed precision under every stage: models DDP trains in "bf16-mixed"/"16-mixed" (fp32 buffers added before a
LayerNorm, on torch's TransformerEncoder and on a Hugging Face model), edits of the parameters reaching the fp32
masters, and one loss scale per optimizer (Note [mixed precision runs any model] in ``engine/precision.py``)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_zero import DynamicLossScaler, ZeroConfig, ZeroOptimizer, ZeroPrecision
from lightning_zero.stage3.sharded_init import shard_module
from tests.harness import run_distributed
from tests.test_lightning_features import STEPS, ZERO_RUNS, LitMLP, full_weights, loader, make_trainer, zero
from tests.test_strategy import _dataset

# fp16 runs start at a scale that overflows neither DDP's fp32 gradients nor ZeRO's fp16 ones, so that both skip the
# same (no) steps; what is compared is the arithmetic, not the overflow schedule.
FP16_SCALE = 2.0**8
TOLERANCE = 2e-2


def sinusoids(length: int, width: int) -> Tensor:
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10_000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


class EncoderWithPositions(nn.Module):
    """Token embeddings plus an fp32 sinusoidal buffer, into a stock post-norm ``nn.TransformerEncoder``: the sum is
    fp32, and its first LayerNorm has bf16 weights under ZeRO."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.register_buffer("positions", sinusoids(16, 32))
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        x = self.embed(tokens) + self.positions[: tokens.size(1)]
        out: Tensor = self.head(self.encoder(x, mask=mask, is_causal=True))
        return out


class HuggingFaceWithPositions(nn.Module):
    """A small GPT-2 built from a config, fed embeddings plus an fp32 sinusoidal buffer (``inputs_embeds``)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0
        )
        config.attn_pdrop = 0.0
        self.gpt = GPT2Model(config)
        self.register_buffer("positions", sinusoids(16, 32))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.gpt.wte(tokens) + self.positions[: tokens.size(1)]
        out: Tensor = self.head(self.gpt(inputs_embeds=x).last_hidden_state)
        return out


MODELS = {"encoder": EncoderWithPositions, "huggingface": HuggingFaceWithPositions}


class LitLanguageModel(pl.LightningModule):
    def __init__(self, model_name: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.model = MODELS[model_name]()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _plugins(strategy: str, precision: str) -> list[Any]:
    if precision == "bf16-mixed":
        return []
    if strategy == "ddp":  # on CPU, Trainer(precision="16-mixed") would become bf16: ask for fp16 explicitly
        return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=FP16_SCALE))]
    return [ZeroPrecision("16-mixed", loss_scaler=DynamicLossScaler(scale=FP16_SCALE))]


def _fit(model_name: str, name: str, precision: str) -> dict[str, Any]:
    module = LitLanguageModel(model_name)
    strategy = "ddp" if name == "ddp" else zero(int(name[-1]))
    kwargs = {"precision": precision} if precision == "bf16-mixed" else {"plugins": _plugins(name, precision)}
    trainer = make_trainer(strategy, **kwargs)
    trainer.fit(module, DataLoader(_dataset("gpt", 2 * 4 * STEPS), batch_size=4))
    return {
        "losses": module.losses,
        "weights": full_weights(trainer, module),
        "buffer": module.model.positions.dtype,
        "params": {p.dtype for p in module.model.parameters()},
    }


def _language_model_runs(model_name: str, precision: str) -> dict[str, dict[str, Any]]:
    return {name: _fit(model_name, name, precision) for name in ("ddp", *ZERO_RUNS)}


def _assert_language_model_matches_ddp(model_name: str, precision: str) -> None:
    ranks = run_distributed(_language_model_runs, 2, model_name, precision, init_process_group=False, timeout=280)
    low = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    for runs in ranks:
        reference = runs["ddp"]
        for name in ZERO_RUNS:
            run = runs[name]
            assert run["params"] == {low}, name  # parameters (and gradients) stay low precision
            assert run["buffer"] == torch.float32, name  # the buffer keeps DDP's precision
            torch.testing.assert_close(
                torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=TOLERANCE, atol=0
            )
            for fqn, expected in reference["weights"].items():
                torch.testing.assert_close(
                    run["weights"][fqn], expected, rtol=TOLERANCE, atol=TOLERANCE, msg=f"{name} {fqn}"
                )


@pytest.mark.timeout(300)
def test_transformer_encoder_with_an_fp32_positional_buffer_trains_under_bf16_mixed_as_under_ddp():
    _assert_language_model_matches_ddp("encoder", "bf16-mixed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transformer_encoder_with_an_fp32_positional_buffer_trains_under_16_mixed_as_under_ddp():
    _assert_language_model_matches_ddp("encoder", "16-mixed")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16-mixed", pytest.param("16-mixed", marks=pytest.mark.slow)])
def test_hugging_face_gpt2_with_an_fp32_positional_buffer_trains_as_under_ddp(precision):
    pytest.importorskip("transformers")
    _assert_language_model_matches_ddp("huggingface", precision)


# -- edits reach the masters -------------------------------------------------------------------------------------
EDITS = ("writeback", "load_state_dict", "ema_swap")
PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _edit_survives(stage: int, precision: str, edit: str) -> bool:
    """Train a step, edit every parameter to exactly representable values, take a step with lr 0: the parameters
    must still hold the edit (a stale fp32 master would overwrite it)."""
    dtype = PRECISIONS[precision]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(dtype)
    config = ZeroConfig(stage=stage, bucket_numel=50)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu")) if stage == 3 else None
    scaler = DynamicLossScaler(scale=FP16_SCALE) if dtype == torch.float16 else None
    optimizer = ZeroOptimizer(
        model, inner, dist.group.WORLD, config, gatherer, fp32_masters=dtype != torch.float32, loss_scaler=scaler
    )

    def full() -> Any:
        return gatherer.gathered(writeback=True) if gatherer is not None else nullcontext()

    def step() -> None:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank())).to(dtype)
        loss = model(x).float().square().mean()
        (loss * (scaler.scale if scaler is not None else 1.0)).backward()
        optimizer.step()

    step()
    edited = {n: (torch.arange(p.numel()).view(p.shape) % 7 - 3).to(dtype) / 8 for n, p in model.named_parameters()}
    with full(), torch.no_grad():
        if edit == "load_state_dict":
            model.load_state_dict(edited)
        for name, param in model.named_parameters():
            if edit == "writeback":
                param.copy_(edited[name])
            elif edit == "ema_swap":  # through .data, as EMA code often swaps: invisible to version counters
                param.data.copy_(edited[name])
    for group in inner.param_groups:
        group["lr"] = 0.0
    step()
    with gatherer.gathered() if gatherer is not None else nullcontext():
        return all(torch.equal(p, edited[n]) for n, p in model.named_parameters())


def _edits() -> dict[str, bool]:
    return {
        f"stage{stage}/{precision}/{edit}": _edit_survives(stage, precision, edit)
        for stage in (1, 2, 3)
        for precision in PRECISIONS
        for edit in EDITS
    }


@pytest.mark.timeout(120)
def test_edited_parameters_are_what_the_next_step_starts_from_under_every_precision_and_stage():
    for survived in run_distributed(_edits, 2):
        assert [case for case, ok in survived.items() if not ok] == []
        assert len(survived) == 3 * 3 * 3


# -- one loss scale per optimizer ----------------------------------------------------------------------------------
OVERFLOW_STEP = 3
GROWTH_INTERVAL = 2


class LitTwoOptimizers(LitMLP):
    """Manual optimization with a body and a head optimizer; the head's gradient overflows at one step on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.scales: list[list[float]] = []

    def configure_optimizers(self) -> Any:
        head, body = self.model.net[-1], self.model.net[:-1]
        return [torch.optim.SGD(body.parameters(), lr=0.05), torch.optim.SGD(head.parameters(), lr=0.05)]

    def on_fit_start(self) -> None:
        def poison(grad: Tensor) -> Tensor:
            if self.global_rank == 1 and len(self.scales) == OVERFLOW_STEP:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        self.model.net[-1].weight.register_hook(poison)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        body, head = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        body.step()
        head.step()
        body.zero_grad()
        head.zero_grad()
        precision = self.trainer.precision_plugin
        assert isinstance(precision, ZeroPrecision)
        self.scales.append([scaler.scale for scaler in precision.loss_scalers])


def _two_optimizers() -> dict[str, Any]:
    results = {}
    for name, stage in (("zero2", 2),):  # the scalers are the strategy's and the optimizer's: the same every stage
        module = LitTwoOptimizers()
        precision = ZeroPrecision("16-mixed", loss_scaler=DynamicLossScaler(scale=2.0**6, growth_interval=2))
        # Manual optimization counts a step per optimizer.step(): two per batch.
        trainer = make_trainer(zero(stage), plugins=[precision], max_steps=2 * STEPS)
        trainer.fit(module, loader(2 * 4 * STEPS))
        weights = full_weights(trainer, module)
        results[name] = {"scales": module.scales, "state": precision.state_dict(), "weights": weights}
    return results


def _alone(overflows: set[int]) -> list[float]:
    """The scales a single optimizer's scaler goes through, overflowing at the given steps."""
    scaler, scales = DynamicLossScaler(scale=2.0**6, growth_interval=GROWTH_INTERVAL), []
    for step in range(STEPS):
        scaler.update(step in overflows)
        scales.append(scaler.scale)
    return scales


@pytest.mark.timeout(180)
def test_two_optimizers_under_16_mixed_each_scale_grows_and_backs_off_as_a_single_optimizers_would():
    body, head = _alone(set()), _alone({OVERFLOW_STEP})
    assert body != head  # the overflow matters: a shared scale could not follow both
    for runs in run_distributed(_two_optimizers, 2, init_process_group=False):
        for name, run in runs.items():
            assert [s[0] for s in run["scales"]] == body, name
            assert [s[1] for s in run["scales"]] == head, name
            assert [entry["scale"] for entry in run["state"]["loss_scalers"]] == [body[-1], head[-1]], name
            assert all(torch.isfinite(w).all() for w in run["weights"].values()), name
