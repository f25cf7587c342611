"""Cases of Lightning's own Trainer strategy and checkpoint tests (``tests_pytorch/strategies/test_fsdp.py``,
``test_ddp_integration.py``, ``test_deepspeed.py``, ``test_model_parallel_integration.py``, ``checkpointing/``,
``trainer/connectors/test_checkpoint_connector.py``), written for ``ZeroStrategy`` and run under Lightning's DDP too,
where numbers are the oracle. Everything here runs inside ranks started by ``tests.harness.run_distributed`` with
``init_process_group=False``: the first Trainer creates the process group, the next ones reuse it.

``battery`` runs every case under every strategy in one set of processes (the suite's budget) and returns, per case
and strategy, what it measured or the traceback it raised, so one failing case does not hide the others.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from tests.harness import fresh_rendezvous_port

STRATEGIES = ("ddp", "zero2", "zero3")
"""The control first: every ZeRO result is compared with Lightning's DDP."""

STEPS = 4
Result = dict[str, Any]


def strategy_for(name: str, **fields: Any) -> str | ZeroStrategy:
    if name == "ddp":
        return "ddp"
    # Small buckets and one unit per Linear at stage 3, so parameters straddle ranks and units.
    stage = int(name[-1])
    return ZeroStrategy(stage=stage, bucket_numel=40, wrap_min_numel=32, collective_timeout_s=30, **fields)


def trainer_for(
    name: str, root: str | None = None, callbacks: Any = (), strategy_fields: Any = None, **kwargs: Any
) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": STEPS,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
        "default_root_dir": root,
        "callbacks": list(callbacks),
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy_for(name, **(strategy_fields or {})), **options)


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loader(samples: int = 2 * 4 * 2 * STEPS, seed: int = 99) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 4, generator=generator))
    return DataLoader(data, batch_size=4)


class PortModule(pl.LightningModule):
    """The model built in ``configure_model`` (on meta at stage 3), a ``torchmetrics`` metric built in ``__init__``,
    two param groups with a per-step schedule, every loop's step, and what each step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None
        self.val_mse = torchmetrics.MeanSquaredError()
        self.configure_calls = 0
        self.losses: list[float] = []
        self.on_meta: bool | None = None

    def configure_model(self) -> None:
        self.configure_calls += 1
        if self.model is None:
            self.model = build()
            self.on_meta = all(p.is_meta for p in self.model.parameters())

    def forward(self, inputs: Tensor) -> Tensor:
        assert self.model is not None
        out: Tensor = self.model(inputs)
        return out

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        out = self(batch[0])
        self.val_mse(out, batch[1])
        self.log("val_loss", nn.functional.mse_loss(out, batch[1]), sync_dist=True)
        self.log("val_mse", self.val_mse)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        assert self.model is not None
        groups = [{"params": self.model[0].parameters()}, {"params": self.model[2].parameters(), "lr": 0.02}]
        optimizer = torch.optim.Adam(groups, lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def weights(trainer: pl.Trainer, module: nn.Module) -> dict[str, Tensor]:
    strategy = trainer.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroStrategy) else nullcontext()
    with context:
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def listing(directory: str) -> list[str]:
    """The names in ``directory``, hidden ones too (a leftover of a removal would show as ``.<name>.trash-...``)."""
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# -- fit, validate, test, predict, fit again, a new Trainer resuming "last"; ModelCheckpoint's top-k ---------------
def lifecycle(name: str, root: str, reference: Result | None) -> Result:
    """Lightning's ``_run_multiple_stages`` and ``test_finetuning_with_ckpt_path`` in one run: ``fit`` with a
    ``ModelCheckpoint`` keeping the best two of a checkpoint per step (and ``last``), ``validate``, ``test`` of the
    module and of ``ckpt_path="best"``, ``predict``, ``fit`` again on the same Trainer with more steps, then a new
    Trainer resuming ``ckpt_path="last"``; ``strategy.lightning_module_state_dict()``, and
    ``LightningModule.state_dict()``/``load_state_dict()`` (at stage 3 of a sharded model) with DDP's final weights;
    last, a new Trainer without a checkpoint validating and training the model on."""
    directory = os.path.join(root, f"lifecycle-{name}", "checkpoints")
    result: Result = {}

    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=directory, monitor="train_loss", save_top_k=2, every_n_train_steps=1, save_last=True
        )

    module = PortModule()
    first = checkpoint()
    trainer = trainer_for(name, root, [first], val_check_interval=2, limit_val_batches=2)
    trainer.fit(module, loader(), loader(16, seed=5))
    result["fit"] = {
        "losses": list(module.losses),
        "on_meta": module.on_meta,
        "metrics": metrics(trainer),
        "listing": listing(directory),
        "best": os.path.basename(first.best_model_path),
        "kept": sorted(os.path.basename(p) for p in first.best_k_models),
        "weights": weights(trainer, module),
    }
    result["validate"] = trainer.validate(module, loader(16, seed=5))
    result["test"] = trainer.test(module, loader(16, seed=6))
    result["test_best"] = trainer.test(ckpt_path="best", dataloaders=loader(16, seed=6))
    result["predict"] = trainer.predict(module, loader(8, seed=7))
    trainer.fit_loop.epoch_loop.max_steps = STEPS + 2  # the same Trainer trains on
    trainer.fit(module, loader(), loader(16, seed=5))
    result["fit_again"] = {"losses": list(module.losses), "weights": weights(trainer, module)}
    second = checkpoint()
    trainer = trainer_for(name, root, [second], max_steps=STEPS + 4, val_check_interval=2, limit_val_batches=2)
    module = PortModule()  # a fresh module: everything comes from the checkpoint
    trainer.fit(module, loader(), loader(16, seed=5), ckpt_path="last")
    result["resumed"] = {
        "losses": list(module.losses),
        "global_step": trainer.global_step,
        "configure_calls": module.configure_calls,
        "listing": listing(directory),
        "weights": weights(trainer, module),
    }
    result["final_validate"] = trainer.validate(module, loader(16, seed=5))
    state = trainer.strategy.lightning_module_state_dict()
    result["strategy_state_types"] = sorted({type(v).__name__ for v in state.values()})
    result["strategy_state"] = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()
    }
    state = module.state_dict()
    result["state_dict"] = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()
    }
    result["state_dict_types"] = sorted({type(v).__name__ for v in state.values()})
    if reference is not None:  # DDP's weights into this model: the same validation as DDP's
        module.load_state_dict(reference["state_dict"])
        result["validate_ddp_weights"] = trainer.validate(module, loader(16, seed=5))
        result["weights_after_load"] = weights(trainer, module)
    # A new Trainer without a checkpoint takes the model over as it is, with a fresh optimizer.
    trainer = trainer_for(name, max_steps=2)
    result["taken_over_validate"] = trainer.validate(module, loader(16, seed=5))
    trainer.fit(module, loader())
    result["taken_over"] = {"losses": module.losses[-2:], "weights": weights(trainer, module)}
    return result


# -- save_checkpoint(weights_only=True), load_from_checkpoint, test/predict from a path under inference_mode ---------
def multiple_stages(name: str, root: str, reference: Result | None) -> Result:
    """Lightning's FSDP ``_run_multiple_stages``: after ``fit``, ``save_checkpoint(path, weights_only=True)``; on rank
    0 ``load_from_checkpoint`` gives ``lightning_module_state_dict()``'s weights; under ``torch.inference_mode()``
    ``test`` and ``predict`` of the module and of ``ckpt_path``. ZeRO with ``state_dict_type="full"`` (one file,
    as FSDP's full state dict)."""
    fields = {} if name == "ddp" else {"state_dict_type": "full"}
    path = os.path.join(root, f"stages-{name}", "weights.ckpt")
    module = PortModule()
    trainer = trainer_for(name, strategy_fields=fields)
    trainer.fit(module, loader())
    path = trainer.strategy.broadcast(path)
    trainer.save_checkpoint(path, weights_only=True)
    full = trainer.strategy.lightning_module_state_dict()
    result: Result = {"full_keys": sorted(full) if trainer.is_global_zero else None}
    if trainer.is_global_zero:
        restored = PortModule.load_from_checkpoint(path)  # calls configure_model, then loads the file
        result["loaded"] = {k: v.clone() for k, v in restored.state_dict().items()}
        result["full"] = {k: v.clone() if isinstance(v, Tensor) else type(v).__name__ for k, v in full.items()}
    with torch.inference_mode():
        result["test"] = trainer.test(module, loader(16, seed=6))
        result["test_path"] = trainer.test(ckpt_path=path, dataloaders=loader(16, seed=6))
        result["predict"] = trainer.predict(module, loader(8, seed=7))
        result["predict_path"] = trainer.predict(ckpt_path=path, dataloaders=loader(8, seed=7))
    return result


def sharded_weights_only(name: str, root: str, reference: Result | None) -> Result:
    """``save_checkpoint(path, weights_only=True)`` of the default sharded format: ``test``/``predict`` from the
    path under ``torch.inference_mode()``; ``load_from_checkpoint`` of the directory is refused (Lightning reads one
    file; ``consolidate`` writes one)."""
    if name == "ddp":
        return {}
    path = os.path.join(root, f"sharded-{name}", "weights.ckpt")
    module = PortModule()
    trainer = trainer_for(name)
    trainer.fit(module, loader())
    path = trainer.strategy.broadcast(path)
    trainer.save_checkpoint(path, weights_only=True)
    result: Result = {"is_dir": os.path.isdir(path)}
    with torch.inference_mode():
        result["test_path"] = trainer.test(module, ckpt_path=path, dataloaders=loader(16, seed=6))
        result["predict_path"] = trainer.predict(module, ckpt_path=path, dataloaders=loader(8, seed=7))
    try:
        PortModule.load_from_checkpoint(path)
        result["load_from_checkpoint"] = None
    except Exception as error:
        result["load_from_checkpoint"] = f"{type(error).__name__}: {error}"
    return result


# -- strict_loading ------------------------------------------------------------------------------------------------
class WithExtraLayer(PortModule):
    def configure_model(self) -> None:
        super().configure_model()
        if not hasattr(self, "extra"):  # built right after the model, from the same seed's stream
            self.extra = nn.Linear(4, 4)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.extra(super().forward(inputs))


def strict_loading(name: str, root: str, reference: Result | None) -> Result:
    """Lightning's ``test_strict_loading``: a checkpoint without the new layer resumes a module that has it when
    ``strict_loading = False``, and is refused with ``strict_loading`` left on."""
    path = os.path.join(root, f"strict-{name}", "checkpoint.ckpt")
    trainer = trainer_for(name, max_steps=2)
    base = PortModule()
    trainer.fit(base, loader())
    path = trainer.strategy.broadcast(path)
    trainer.save_checkpoint(path)
    saved = weights(trainer, base)
    result: Result = {}
    for strict in (True, False):
        module = WithExtraLayer()
        module.strict_loading = strict
        trainer = trainer_for(name, max_steps=3)
        try:
            trainer.fit(module, loader(), ckpt_path=path)
            loaded = weights(trainer, module)
            result[strict] = {"losses": module.losses, "weights": loaded}
        except Exception as error:
            result[strict] = f"{type(error).__name__}: {error}"
    result["saved"] = saved
    return result


# -- manual optimization with clipping -----------------------------------------------------------------------------
class ManualModule(PortModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        for half in (slice(0, 2), slice(2, 4)):  # two steps per batch
            loss = nn.functional.mse_loss(self(batch[0][half]), batch[1][half])
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
            optimizer.step()  # type: ignore[union-attr]
            self.losses.append(loss.item())
        scheduler.step()  # type: ignore[union-attr]


def manual_optimization(name: str, root: str, reference: Result | None) -> Result:
    module = ManualModule()
    trainer = trainer_for(name)
    trainer.fit(module, loader())
    return {"losses": module.losses, "weights": weights(trainer, module)}


# -- *_spawn: what comes back to the main process ----------------------------------------------------------------
class BuiltInInit(PortModule):
    """The model built in ``__init__``, so that the main process holds it to receive the weights into."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build()


def spawn_fit(strategy: str, root: str) -> Result:
    """``fit`` under Lightning's own multiprocessing launcher, called in the main process: the weights, metrics and
    best checkpoint path the main process gets back (Lightning's ``test_ddp_spawn`` checks)."""
    fresh_rendezvous_port()
    module = BuiltInInit()
    checkpoint = ModelCheckpoint(dirpath=f"{root}/{strategy}", monitor="train_loss", save_top_k=1)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader())
    return {
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "metrics": metrics(trainer),
        "best": os.path.relpath(checkpoint.best_model_path, root),
    }


# -- a rank killed in the middle of a save, then ckpt_path="last" --------------------------------------------------
KILL_STEPS = 12
"""Steps of the kill-and-resume runs; ``last`` is saved every 2 steps."""


def last_every_two_steps(root: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)


def killed_in_a_save(root: str, stage: int, victim: int, save: int) -> None:
    """Train (resuming ``last`` when there is one) until the ``save``-th save of this run, in which rank ``victim``
    is SIGKILLed once its shard is on disk and before the save is committed."""
    import signal

    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from tests.test_checkpoint_trainer import fit, zero

    write_data = FileSystemWriter.write_data
    calls = []

    def write_then_die(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        future = write_data(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == save and dist.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    fit(zero(stage), 2, KILL_STEPS, root, ckpt="last", callbacks=[last_every_two_steps(root)])


def resumed_from_last(root: str, stage: int) -> Result:
    """Resume ``last`` to the end: the step it started from, the final weights, what the checkpoint directory holds."""
    from tests.test_checkpoint_trainer import fit, zero
    from tests.test_checkpoint_trainer import weights as module_weights

    class StartStep(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.step = trainer.global_step

    start = StartStep()
    module = fit(zero(stage), 2, KILL_STEPS, root, ckpt="last", callbacks=[last_every_two_steps(root), start])
    return {"start": start.step, "weights": module_weights(module), "listing": listing(f"{root}/ck")}


def uninterrupted(root: str, stage: int) -> dict[str, Tensor]:
    from tests.test_checkpoint_trainer import fit, zero
    from tests.test_checkpoint_trainer import weights as module_weights

    return module_weights(fit(zero(stage), 2, KILL_STEPS, root))


CASES: dict[str, Callable[[str, str, Result | None], Result]] = {
    "lifecycle": lifecycle,
    "multiple_stages": multiple_stages,
    "sharded_weights_only": sharded_weights_only,
    "strict_loading": strict_loading,
    "manual_optimization": manual_optimization,
}


def battery(root: str, cases: list[str] | None = None, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """Every case under every strategy: ``{case: {strategy: result or traceback text}}``; a case gets DDP's result
    as ``reference`` (for ``load_state_dict`` of DDP's weights)."""
    results: dict[str, Any] = {}
    for case in cases or list(CASES):
        results[case] = {}
        for name in strategies:
            reference = results[case].get("ddp")
            try:
                results[case][name] = CASES[case](name, root, reference if isinstance(reference, dict) else None)
            except Exception:
                results[case][name] = traceback.format_exc()
    return results
