"""Loops for ``tests/test_module_surface.py``: a stage-3 model used through plain ``nn.Module`` calls (``state_dict``,
``load_state_dict`` and its hooks, a forward on one rank), under ``Fabric(strategy="zero3")`` and, as the oracle,
Fabric's DDP. Everything here runs inside a rank started by ``tests.harness.run_distributed``
(``init_process_group=False``)."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.load import _lazy_load
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from lightning_zero.models.gpt import GPT, GPTConfig
from tests import parity
from tests.harness import fresh_rendezvous_port


class Renamed(nn.Module):
    """A layer that renames its checkpoint keys in a load pre-hook, as LitGPT's LoRA layers do (``weight`` of a
    plain linear is ``linear.weight`` here), and counts its post-hook calls."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.post_hook_calls = 0
        self.register_load_state_dict_pre_hook(self._rename)
        self.register_load_state_dict_post_hook(self._count)

    @staticmethod
    def _rename(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)

    def _count(self, module: nn.Module, keys: Any) -> None:
        self.post_hook_calls += 1

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear(x)
        return out


class HookedGPT(nn.Module):
    """The tests' GPT with a renaming layer before its head."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
        self.mix = Renamed(64)

    def forward(self, tokens: Tensor) -> Tensor:
        out: Tensor = self.mix(self.gpt(tokens))
        return out


def _model() -> nn.Module:
    torch.manual_seed(1234)
    return HookedGPT()


def _fabric(strategy: str | ZeroFabricStrategy, precision: str, world: int = 2) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def _loss(model: Any, rank: int, step: int) -> Tensor:
    x, y = parity.batch("gpt", rank, step, 0)
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = _loss(model, fabric.global_rank, step)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _full(state: dict[str, Any]) -> dict[str, Tensor]:
    """A state dict's entries whole (DTensors gathered: collective)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone() for k, v in state.items()}


def _strategy(name: str, directory: str) -> str | ZeroFabricStrategy:
    """``name``: a registered strategy, or ``"zeropp"`` (ZeRO++'s three switches, 4 ranks as 2 nodes x 2) or
    ``"disk_tiers"`` (parameters and optimizer state on disk)."""
    if name == "zeropp":
        return ZeroFabricStrategy(
            stage=3, ranks_per_node=2, hpz_partition_size=2, quantize_weights=True, quantize_gradients=True
        )
    if name == "disk_tiers":
        return ZeroFabricStrategy(stage=3, offload_params="disk", offload_optimizer="disk", offload_dir=directory)
    return name


def round_trip(strategy: str, precision: str, directory: str, world: int = 2) -> dict[str, Any]:
    """Train, take ``state_dict()`` and save it as DDP's users do (rank 0's ``torch.save`` of plain tensors, with the
    renamed layer's keys as a plain linear names them), train on, load the file back lazily with
    ``load_state_dict`` (Lightning's lazy loader, the renaming pre-hook, the post-hooks) and train on again."""
    fabric = _fabric(_strategy(strategy, directory), precision, world)
    zero = isinstance(fabric.strategy, ZeroFabricStrategy)
    model = fabric.setup_module(_model())  # built whole: the same initial weights in every precision
    # SGD: Adam's normalized step turns bf16's rounding of tiny gradients into whole steps (tests/test_precision.py)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    losses = _train(fabric, model, optimizer, 3)
    state = model.state_dict()
    kinds = sorted({type(v).__name__ for v in state.values()})
    local = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel() for v in state.values())
    full = _full(state)
    with fabric.strategy.full_state_dict() if zero else nullcontext():  # type: ignore[attr-defined]
        whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = os.path.join(directory, f"{strategy}-{precision}.pt")
    if fabric.global_rank == 0:
        torch.save({k.replace("mix.linear.", "mix."): v for k, v in full.items()}, path)
    fabric.barrier()
    losses += _train(fabric, model, optimizer, 2, start=3)
    keys = model.load_state_dict(_lazy_load(path), strict=True)
    reloaded = _full(model.state_dict())
    losses += _train(fabric, model, optimizer, 2, start=5)
    return {
        "losses": losses,
        "kinds": kinds,
        "full": full,
        "whole": whole,
        "local": local,
        "reloaded": reloaded,
        "keys": (list(keys.missing_keys), list(keys.unexpected_keys)),
        "post_hooks": model.mix.post_hook_calls,
    }


def inside_gather(directory: str) -> dict[str, Any]:
    """``state_dict()`` taken inside ``gathered_parameters()`` and saved after it: a file that loads, with the
    weights."""
    fabric = _fabric("zero3", "32-true")
    with fabric.init_module(empty_init=True):
        model = _model()
    model = fabric.setup_module(model)
    with fabric.strategy.gathered_parameters():
        state = model.state_dict()
        inside = {k: v.detach().clone() for k, v in state.items()}
    path = os.path.join(directory, "inside.pt")
    if fabric.global_rank == 0:
        torch.save(state, path)
    fabric.barrier()
    loaded = torch.load(path, weights_only=True)
    errors = []
    wrong = {**inside, "gpt.wte.weight": torch.zeros(3, 3)}
    for bad in ({"state_dict": wrong}, {"state_dict": inside, "assign": True}):
        try:
            model.load_state_dict(**bad)
        except (RuntimeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    x, _ = parity.batch("gpt", 0, 7, 0)
    with torch.no_grad():  # every parameter is back in place after the failed loads
        usable = bool(torch.isfinite(model(x)).all())
    return {
        "errors": errors,
        "usable": usable,
        "same": all(torch.equal(loaded[k], inside[k]) for k in inside),
        "nbytes": sum(t.untyped_storage().nbytes() for t in state.values()),
        "expected": sum(t.numel() * t.element_size() for t in inside.values()),
    }


def one_rank_forward(then: str) -> dict[str, Any]:
    """Rank 0 samples alone (forwards without gradients, ``state_dict()``, ``gathered_parameters()``,
    ``load_state_dict()``) while rank 1 waits in
    ``fabric.barrier()`` (``then == "barrier"``), as LitGPT's ``generate_example`` does, or goes on to train (``then ==
    "train"``), which cannot serve it."""
    fabric = _fabric(ZeroFabricStrategy(stage=3, collective_timeout_s=4.0), "32-true")
    with fabric.init_module(empty_init=True):
        model = _model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, 1)
    x, _ = parity.batch("gpt", 0, 7, 0)
    with torch.no_grad():
        everyone = model(x).clone()  # on every rank: the oracle for rank 0's lone calls
    expected = _full(model.state_dict())
    start = time.monotonic()
    outcome: Any = None
    if fabric.global_rank == 0:
        try:
            with torch.no_grad():
                outcome = [bool(torch.equal(model(x), everyone)) for _ in range(2)]
            alone = model.state_dict()  # the rows this rank holds, gathered with the waiting rank's help
            outcome.append(all(torch.equal(alone[k].to_local(), expected[k].chunk(2)[0]) for k in expected))
            with fabric.strategy.gathered_parameters():  # served too
                gathered = {n: p.detach().clone() for n, p in model.module.named_parameters()}
            outcome.append(all(torch.equal(gathered[k], expected[k]) for k in gathered))
            keys = model.load_state_dict(expected)  # no gather at all: as DDP's load on one rank
            outcome.append(not keys.missing_keys and not keys.unexpected_keys)
        except Exception as error:  # returned for the test to read
            outcome = f"{type(error).__name__}: {error}"
            return {"outcome": outcome, "elapsed": time.monotonic() - start, "after": None}
    if then == "barrier":
        fabric.barrier()
    else:
        try:
            _train(fabric, model, optimizer, 1)
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
    elapsed = time.monotonic() - start
    after = _train(fabric, model, optimizer, 2, start=2) if then == "barrier" else None
    return {"outcome": outcome, "elapsed": elapsed, "after": after}


class _Sampling(pl.LightningModule):
    """The tests' GPT with validation; at the end of each validation epoch rank 0 samples alone (a forward without
    gradients in a Lightning hook) and every rank then waits in the strategy's barrier, as Lightning projects do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.samples: list[Tensor] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.cross_entropy(self.model(batch[0]).flatten(0, 1), batch[1].flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = nn.functional.cross_entropy(self.model(batch[0]).flatten(0, 1), batch[1].flatten())
        self.val_losses.append(float(loss))

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        if self.global_rank == 0:
            with torch.no_grad():
                self.samples.append(self.model(torch.arange(8).unsqueeze(0)).argmax(-1).clone())
        self.trainer.strategy.barrier()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, 64, (32, 17), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def _trainer(strategy: Any, max_steps: int = 3) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        val_check_interval=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit_validate_fit(strategy: str) -> dict[str, Any]:
    """``fit`` with one Trainer, then ``validate`` and ``fit`` again with a second one (as Lightning's FSDP tests do),
    sampling on rank 0 alone after each validation."""

    def make() -> Any:
        return ZeroStrategy(stage=3, collective_timeout_s=20.0) if strategy == "zero3" else strategy

    module = _Sampling()
    _trainer(make()).fit(module, _loader(), _loader())
    second = _trainer(make())
    second.validate(module, _loader())
    second.fit(module, _loader(), _loader())
    context = second.strategy.gathered_parameters() if isinstance(second.strategy, ZeroStrategy) else nullcontext()
    with context:
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": module.losses, "val": module.val_losses, "samples": module.samples, "weights": weights}


def spawn_fit(strategy: str) -> dict[str, Tensor]:
    """``fit`` under Lightning's own multiprocessing launcher; the weights the main process gets back."""
    fresh_rendezvous_port()
    module = _Sampling()
    trainer = _trainer(strategy)
    trainer.fit(module, _loader(), _loader())
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def peft_adapters(strategy: str | ZeroFabricStrategy, directory: str, world: int = 2) -> dict[str, Any]:
    """peft's own adapter save and load on a LoRA Llama: ``get_peft_model_state_dict`` (``model.state_dict()``
    filtered) saved by rank 0, training on, ``set_peft_model_state_dict`` (peft's key renames, then
    ``model.load_state_dict(strict=False)``) of the file, training on, then ``merge_and_unload`` and the merged
    model's ``save_pretrained``."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from tests import third_party_models

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world)  # type: ignore[arg-type]
    fabric.launch()
    model = fabric.setup_module(third_party_models.hf_lora().model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.SGD(trainable, lr=0.5, momentum=0.9))

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            loss = third_party_models._hf_loss(model, third_party_models._token_batch(fabric.global_rank, step))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    losses = train(range(2))
    adapters = _full(get_peft_model_state_dict(model.module))
    # peft's save_pretrained (safetensors, written by the main process) with full tensors on every rank
    saved = os.path.join(directory, f"pretrained-{type(fabric.strategy).__name__}-{world}")
    zero = isinstance(fabric.strategy, ZeroFabricStrategy)
    with fabric.strategy.full_state_dict() if zero else nullcontext():  # type: ignore[attr-defined]
        model.module.save_pretrained(saved, is_main_process=fabric.global_rank == 0)
    fabric.barrier()
    path = os.path.join(directory, f"adapters-{fabric.strategy.__class__.__name__}-{world}.pt")
    if fabric.global_rank == 0:
        torch.save(adapters, path)
    fabric.barrier()
    losses += train(range(2, 4))
    result = set_peft_model_state_dict(model.module, torch.load(path, weights_only=True))
    reloaded = _full(get_peft_model_state_dict(model.module))
    losses += train(range(4, 6))
    # peft's merge_and_unload writes into the base weights: at stage 3 inside gathered_parameters(writeback=True)
    merged_dir = os.path.join(directory, f"merged-{type(fabric.strategy).__name__}-{world}")
    with fabric.strategy.gathered_parameters(model.module, writeback=True) if zero else nullcontext():  # type: ignore[attr-defined]
        merged = model.module.merge_and_unload()
    with fabric.strategy.full_state_dict() if zero else nullcontext():  # type: ignore[attr-defined]
        merged.save_pretrained(merged_dir, is_main_process=fabric.global_rank == 0)
    fabric.barrier()
    from safetensors.torch import load_file

    return {
        "losses": losses,
        "adapters": adapters,
        "pretrained": load_file(os.path.join(saved, "adapter_model.safetensors")),
        "merged": load_file(os.path.join(merged_dir, "model.safetensors")),
        "reloaded": reloaded,
        "unexpected": list(result.unexpected_keys),
    }


def dcp_full_state_dict() -> dict[str, Any]:
    """torch's ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on the stage-3 model: rank 0 gets
    the full weights (those ``gathered_parameters()`` shows), the others nothing."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    fabric = _fabric("zero3", "32-true")
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, 2)
    full = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with fabric.strategy.gathered_parameters():
        expected = {n: p.detach().clone() for n, p in model.module.named_parameters(remove_duplicate=False)}
    if fabric.global_rank != 0:
        return {"equal": full == {}, "keys": sorted(full)}
    equal = full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in expected)
    return {"equal": equal, "keys": sorted(set(full) ^ set(expected))}


class _SamplingWithoutBarrier(_Sampling):
    """Rank 0 samples alone after validation, and the other ranks do not wait for it: they train on."""

    def on_validation_epoch_end(self) -> None:
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            with torch.no_grad():
                self.model(torch.arange(8).unsqueeze(0))


def one_rank_trainer_unserved() -> dict[str, Any]:
    """Under the Trainer, a forward on rank 0 alone that no rank waits for: it fails within seconds."""
    trainer = _trainer(ZeroStrategy(stage=3, collective_timeout_s=4.0), max_steps=6)
    start = time.monotonic()
    try:
        trainer.fit(_SamplingWithoutBarrier(), _loader(), _loader())
        outcome = "finished"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "elapsed": time.monotonic() - start}
