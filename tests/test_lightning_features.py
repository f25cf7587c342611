"""What a Lightning training loop does, under ZeRO stages 1, 2 and 3, against ``Trainer(strategy="ddp")``: gradient
clipping, gradient accumulation, a learning rate set in ``optimizer_step``, a frozen backbone. The machinery here is
shared by the other ``test_lightning_*`` files and ``test_precision.py``.

Each feature trains the same module on the same data with DDP and with every stage, in one ``run_distributed`` call
(the runs are cached per feature, so the tests that read one run from different angles share it), and compares the
loss of every step, the learning rates and the final weights (fp32: relative 1e-5).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroOptimizer, ZeroStrategy
from tests.harness import run_distributed
from tests.parity import build_model, build_optimizer, loss_fn
from tests.test_strategy import _dataset

STEPS = 8
BUCKET_NUMEL = 300  # splits the 1,445-parameter MLP into several buckets per param group
ZERO_RUNS = ("zero1", "zero2", "zero3")
Run = Callable[[Any], dict]
"""A feature: trains with the given strategy, returns ``summarize``'s result. Module-level, so ranks can unpickle it."""
Extra = tuple[str, Callable[[], Any], Run | None]
"""A run beyond DDP and zero1/2/3: (name, strategy factory, feature to run instead, or None for the same)."""


# -- shared pieces --------------------------------------------------------------------------------------------------
class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call, so a test can compare what each strategy logged."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((step, {k: float(v) for k, v in metrics.items()}))


def zero(stage: int, **config: Any) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, bucket_numel=BUCKET_NUMEL, **config)


def make_trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": STEPS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def loader(samples: int) -> DataLoader:
    # Lightning adds a DistributedSampler: each rank sees its own half, identically for every strategy.
    return DataLoader(_dataset("mlp", samples), batch_size=4)


def full_weights(trainer: pl.Trainer, module: torch.nn.Module) -> dict[str, Tensor]:
    strategy = trainer.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroStrategy) else nullcontext()
    with context:
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def summarize(trainer: pl.Trainer, module: Any) -> dict[str, Any]:
    """What a run produced, as plain picklable values."""
    result: dict[str, Any] = {
        "losses": module.losses,
        "lrs": module.lrs,
        "weights": full_weights(trainer, module),
        "logged": trainer.logger.history if isinstance(trainer.logger, MemoryLogger) else [],
    }
    if isinstance(trainer.strategy, ZeroStrategy):
        result["state"] = trainer.strategy.model_state_bytes()
        result["sent"] = trainer.strategy.communication_per_step()
    return result


def assert_matches_ddp(reference: dict, sharded: dict, rtol: float = 1e-5, atol: float = 1e-6, label: str = "") -> None:
    assert len(sharded["losses"]) == len(reference["losses"]) > 0, label
    torch.testing.assert_close(
        torch.tensor(sharded["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol, msg=f"{label} losses"
    )
    assert sharded["lrs"] == reference["lrs"], label
    assert sharded["weights"].keys() == reference["weights"].keys()
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], expected, rtol=rtol, atol=atol, msg=f"{label} {name}")


class LitMLP(pl.LightningModule):
    """The parity MLP (two param groups, SGD with momentum by default); records every loss and learning rate."""

    def __init__(self, optimizer_name: str = "sgd") -> None:
        super().__init__()
        self.optimizer_name = optimizer_name
        self.model = build_model("mlp")
        self.losses: list[Any] = []
        self.lrs: list[list[float]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = loss_fn("mlp", self.model, batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", loss_fn("mlp", self.model, batch), sync_dist=True)

    def on_train_batch_end(self, *args: Any) -> None:
        self.lrs.append([g["lr"] for opt in self.trainer.optimizers for g in opt.param_groups])

    def configure_optimizers(self) -> Any:
        return build_optimizer(self.optimizer_name, self.model)


def fit(strategy: Any, module: pl.LightningModule, samples: int = 2 * 4 * STEPS, **trainer_kwargs: Any) -> dict:
    trainer = make_trainer(strategy, **trainer_kwargs)
    trainer.fit(module, loader(samples))
    return summarize(trainer, module)


# -- features: each maps a strategy to one run's summary ---------------------------------------------------------------
def _clip_norm(strategy: Any) -> dict:
    return fit(strategy, LitMLP(), gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def _clip_value(strategy: Any) -> dict:
    return fit(strategy, LitMLP(), gradient_clip_val=0.002, gradient_clip_algorithm="value")


def _no_clip(strategy: Any) -> dict:
    return fit(strategy, LitMLP())


def _ddp() -> str:
    return "ddp"


# Without clipping: shows that the clip value really changed the training.
NO_CLIP: tuple[Extra, ...] = (("ddp_no_clip", _ddp, _no_clip),)


class _LedgerPerMicroBatch(pl.Callback):
    """After every micro-batch: what ZeRO has sent since the last optimizer step, and in the last whole step."""

    def __init__(self) -> None:
        self.pending: list[dict[str, int]] = []
        self.last_step: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        optimizer = trainer.strategy.optimizers[0]
        if isinstance(optimizer, ZeroOptimizer):
            self.pending.append({kind.value: n for kind, n in optimizer.ledger.current.items() if n})
            self.last_step.append(optimizer.ledger.last_step_bytes())


ACCUMULATE = 3
EPOCH_BATCHES = 5  # each epoch ends with a window of 2 micro-batches, which Lightning steps at the epoch's end


def _window(batch: int) -> tuple[int, int]:
    """(position in its accumulation window, window length) of the ``batch``-th micro-batch of the fit."""
    start = (batch % EPOCH_BATCHES) // ACCUMULATE * ACCUMULATE
    return batch % EPOCH_BATCHES - start, min(ACCUMULATE, EPOCH_BATCHES - start)


LOCAL_ACCUMULATION: tuple[Extra, ...] = (
    ("zero2_local", functools.partial(zero, 2, grad_accumulation="local"), None),
    ("zero3_local", functools.partial(zero, 3, grad_accumulation="local"), None),
)


def _accumulate(strategy: Any) -> dict:
    ledger = _LedgerPerMicroBatch()
    module = LitMLP("adamw")
    trainer = make_trainer(strategy, max_steps=-1, max_epochs=4, accumulate_grad_batches=ACCUMULATE, callbacks=[ledger])
    trainer.fit(module, loader(2 * 4 * EPOCH_BATCHES))
    return {**summarize(trainer, module), "pending": ledger.pending, "last_step": ledger.last_step}


def _warmup(strategy: Any) -> dict:
    return fit(strategy, LitWarmup())


class LitWarmup(LitMLP):
    """Linear warm-up written the usual Lightning way: ``optimizer_step`` sets each group's LR, then steps."""

    WARMUP = 4

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if not hasattr(self, "base_lrs"):
            self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        scale = min(1.0, (self.trainer.global_step + 1) / self.WARMUP)
        for group, base in zip(optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = scale * base
        optimizer.step(closure=optimizer_closure)


FROZEN_LAYERS = 2  # the first Linear and its LayerNorm: the "backbone"


class LitFrozen(LitMLP):
    """A frozen backbone; the optimizer is built over *all* parameters, frozen ones included, as users often do."""

    def __init__(self) -> None:
        super().__init__()
        self.model.net[:FROZEN_LAYERS].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _frozen(strategy: Any) -> dict:
    module = LitFrozen()
    trainer = make_trainer(strategy)
    trainer.fit(module, loader(2 * 4 * STEPS))
    result = summarize(trainer, module)
    if isinstance(trainer.strategy, ZeroStrategy):
        gatherer = trainer.strategy._gatherer
        optimizer = trainer.strategy.optimizers[0]
        assert isinstance(optimizer, ZeroOptimizer)
        result["trainable_buckets"] = len(gatherer.reducer.buckets if gatherer is not None else optimizer.buckets)
    return result


# -- running a feature under DDP and every stage --------------------------------------------------------------------
def _runs_on_rank(feature: Run, ddp: str, extras: tuple[Extra, ...]) -> dict[str, dict]:
    runs: dict[str, tuple[Callable[[], Any], Run | None]] = {
        "ddp": (lambda: ddp, None),
        "zero1": (lambda: zero(1), None),
        "zero2": (lambda: zero(2), None),
        "zero3": (lambda: zero(3), None),
    }
    runs.update({name: (make, other) for name, make, other in extras})
    return {name: (other or feature)(make()) for name, (make, other) in runs.items()}


def feature_runs(feature: Run, ddp: str = "ddp", extras: tuple[Extra, ...] = ()) -> tuple[dict[str, dict], ...]:
    """Every rank's runs of ``feature``, computed once per test session (several tests read the same runs)."""
    # Every argument passed positionally: functools.cache keys on the arguments as given, so ``(f, "ddp")`` and
    # ``(f, "ddp", ())`` would each train their own runs.
    return _feature_runs(feature, ddp, extras)


@functools.cache
def _feature_runs(feature: Run, ddp: str, extras: tuple[Extra, ...]) -> tuple[dict[str, dict], ...]:
    return tuple(run_distributed(_runs_on_rank, 2, feature, ddp, extras, init_process_group=False, timeout=180))


def assert_every_stage_matches_ddp(
    feature: Run, ddp: str = "ddp", extras: tuple[Extra, ...] = ()
) -> list[dict[str, dict]]:
    ranks = feature_runs(feature, ddp, extras)
    for runs in ranks:
        # Extras that run the same feature with another strategy must match DDP too; other features are references.
        for name in (*ZERO_RUNS, *(name for name, _, other in extras if other is None)):
            assert_matches_ddp(runs["ddp"], runs[name], label=f"{feature.__name__}/{name}")
    return list(ranks)


# -- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("feature", [_clip_norm, _clip_value], ids=["norm", "value"])
def test_gradient_clipping_matches_ddp_under_every_stage(feature):
    for runs in assert_every_stage_matches_ddp(feature, extras=NO_CLIP):
        unclipped = runs["ddp_no_clip"]["weights"]
        differs = [not torch.allclose(w, unclipped[n], rtol=1e-4) for n, w in runs["ddp"]["weights"].items()]
        assert any(differs), "the clip value never took effect: the test would not notice clipping being skipped"


@pytest.mark.timeout(240)
def test_accumulate_grad_batches_matches_ddp_under_every_stage_and_accumulation_mode():
    for runs in assert_every_stage_matches_ddp(_accumulate, extras=LOCAL_ACCUMULATION):
        assert len(runs["ddp"]["losses"]) == 4 * EPOCH_BATCHES
        for i in range(4 * EPOCH_BATCHES):
            position, length = _window(i)
            if position == length - 1:
                # The step has run: its traffic moved to the ledger's last step. Per micro-batch, "sharded"
                # reduce-scatters what "local" reduce-scatters once per step (stage 1 does that too).
                assert all(runs[name]["pending"][i] == {} for name in runs if name != "ddp"), i
                once = runs["zero1"]["last_step"][i]["reduce_scatter"]
                assert runs["zero2_local"]["last_step"][i]["reduce_scatter"] == once
                assert runs["zero2"]["last_step"][i]["reduce_scatter"] == length * once
                local = runs["zero3_local"]["last_step"][i]["reduce_scatter"]
                assert runs["zero3"]["last_step"][i]["reduce_scatter"] == length * local
                continue
            # Stage 1 keeps full gradients: nothing at all goes over the wire before the last micro-batch.
            assert runs["zero1"]["pending"][i] == {}, i
            for stage in (2, 3):
                local, sharded = runs[f"zero{stage}_local"]["pending"][i], runs[f"zero{stage}"]["pending"][i]
                assert "reduce_scatter" not in local, (stage, i, local)
                first = runs[f"zero{stage}"]["pending"][i - position]["reduce_scatter"]
                assert sharded["reduce_scatter"] == (position + 1) * first, (stage, i, sharded)


@pytest.mark.timeout(240)
def test_learning_rate_set_in_an_optimizer_step_override_matches_ddp_under_every_stage():
    for runs in assert_every_stage_matches_ddp(_warmup):
        assert runs["ddp"]["lrs"][0][0] == pytest.approx(0.05 / LitWarmup.WARMUP)  # the override took effect


@pytest.mark.timeout(240)
def test_frozen_backbone_gets_no_state_or_communication_and_matches_ddp_under_every_stage():
    ranks = assert_every_stage_matches_ddp(_frozen)
    initial = LitFrozen()
    frozen = {n: p.detach() for n, p in initial.named_parameters() if not p.requires_grad}
    trainable = sum(p.numel() for p in initial.parameters() if p.requires_grad)
    assert frozen
    assert trainable
    for name in ZERO_RUNS:
        # Adam keeps two fp32 moments for exactly the trainable elements, split across the ranks.
        assert sum(runs[name]["state"].optimizer_state for runs in ranks) == 8 * trainable, name
        runs = ranks[0][name]
        buckets = runs["trainable_buckets"]
        # Reduce-scatter at N = 2 sends half of the padded fp32 gradient buckets: trainable elements only.
        reduced = 2 * runs["sent"]["reduce_scatter"] // 4
        assert trainable <= reduced < trainable + 2 * buckets, (name, reduced, trainable)
        grads = sum(r[name]["state"].gradients for r in ranks) // (2 if name == "zero1" else 1)
        assert 4 * trainable <= grads < 4 * (trainable + 2 * buckets), (name, grads)
        for fqn, value in frozen.items():
            torch.testing.assert_close(runs["weights"][fqn], value, rtol=0, atol=0, msg=f"{name}: {fqn} moved")
