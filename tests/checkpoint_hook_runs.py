"""Runs for ``tests/test_checkpoint_hooks.py``: Lightning's checkpoint hooks (``on_save_checkpoint``,
``on_load_checkpoint``) reading and editing ``checkpoint["state_dict"]`` under ZeRO and, as the oracle, DDP. Everything
here runs inside a rank started by ``tests.harness.run_distributed`` (``init_process_group=False``)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy, consolidate_checkpoint
from tests.test_checkpoint_trainer import TinyGPT, weights

STEPS = 3


class LoggedGPT(TinyGPT):
    """The Trainer tests' GPT (tied embeddings, a frozen parameter, a buffer), recording its losses."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__(lr)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


class RenamedGPT(LoggedGPT):
    """The same model after a refactor renamed its ``model`` child to ``net``; ``on_load_checkpoint`` maps the keys of
    checkpoints saved before it, as a user's migration does; with ``replace`` it also puts its own values in place of
    one entry: written into it in place on every rank (``"every"``), a new tensor put there on every rank
    (``"new"``) or on rank 0 alone (``"rank0"``, a hook under ``rank_zero_only``), or half the saved values, read in
    the hook (``"half"``)."""

    def __init__(self, lr: float = 3e-3, remap: bool = True, replace: str | None = None) -> None:
        super().__init__(lr)
        self.net = self._modules.pop("model")
        self.remap = remap
        self.replace = replace

    @property  # type: ignore[override]
    def model(self) -> nn.Module:
        return self.net

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.remap:
            state = checkpoint["state_dict"]
            for key in [k for k in state if k.startswith("model.")]:
                state["net." + key.removeprefix("model.")] = state.pop(key)
        if self.replace == "every":
            state["net.ln_f.weight"].copy_(torch.full(state["net.ln_f.weight"].shape, 0.25))
        elif self.replace == "new" or (self.replace == "rank0" and self.global_rank == 0):
            state["net.ln_f.weight"] = torch.full(state["net.ln_f.weight"].shape, 0.25)
        elif self.replace == "half":
            state["net.ln_f.weight"] = state["net.ln_f.weight"] * 0.5


def _trainable(module: nn.Module) -> list[str]:
    return [k for k, p in module.named_parameters() if p.requires_grad]


def _frozen(module: nn.Module) -> list[str]:
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    return [k for k, v in module.state_dict(keep_vars=True).items() if id(v) in frozen]


def _norm(value: Tensor) -> float:
    norm = value.detach().float().norm()
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # FSDP2's way for a DTensor


class SaveHooks(pl.Callback):
    """What hooks we did not write do in ``on_save_checkpoint``: log the norm of every entry, put an EMA's weights in
    place of some (kept from ``state_dict()`` after each step), rename an entry, drop the frozen base, add a tensor;
    or write into an entry in place (``in_place``)."""

    def __init__(self, in_place: bool = False) -> None:
        self.in_place = in_place
        self.ema: dict[str, Tensor] = {}
        self.norms: dict[str, float] = {}
        self.types: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        state = pl_module.state_dict()  # DTensors at stage 3, on every rank
        for key in _trainable(pl_module)[0::2]:
            value = state[key].detach()
            self.ema[key] = value.clone() if key not in self.ema else self.ema[key] * 0.5 + value * 0.5

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint["state_dict"]
        self.types = {type(v).__name__ for v in state.values()}
        if self.in_place:
            state[_trainable(pl_module)[1]].mul_(2.0)
            return
        self.norms = {k: _norm(v) for k, v in state.items() if v.is_floating_point()}
        state.update({k: v.clone() for k, v in self.ema.items()})
        renamed = _trainable(pl_module)[1]
        state["renamed." + renamed] = state.pop(renamed)
        for key in _frozen(pl_module):
            del state[key]
        state["extra.scale"] = torch.arange(3.0)


class HalfHook(pl.Callback):
    """Casts one entry to half, as a hook shrinking a checkpoint does."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        key = _trainable(pl_module)[3]
        checkpoint["state_dict"][key] = checkpoint["state_dict"][key].half()


class Left(pl.Callback):
    """Records, after the editing hooks, the tensors they put in the checkpoint (whole, on rank 0)."""

    def __init__(self) -> None:
        self.left: dict[str, Tensor] = {}

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint["state_dict"]
        trainable = _trainable(pl_module)
        for key in [*trainable[0::2], trainable[3], "extra.scale"]:
            value = state[key].detach()
            whole = value.full_tensor() if isinstance(value, DTensor) else value  # collective: every rank
            self.left[key] = whole.to("cpu", copy=True)


class NormHook(pl.Callback):
    """Reads every entry (a norm for the logs) and changes nothing."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.norms.append({k: _norm(v) for k, v in checkpoint["state_dict"].items() if v.is_floating_point()})


class Probe(pl.Callback):
    """Counts the elements of the model's values the save's hooks read so far (stage 3: ``LazyValues``), against the
    model's, the rows of it a rank holds and its largest bucket."""

    def __init__(self) -> None:
        self.kept: int | None = None
        self.sizes: dict[str, int] = {}

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        entries = getattr(trainer.strategy, "_hook_entries", None)
        values = getattr(entries, "_values", None)
        if values is None:
            return
        self.kept = sum(t.numel() for t in values._kept.values())
        world = trainer.world_size
        shapes = [p.shape for p in pl_module.parameters() if id(p) in values.module_state.sharded]
        rows = [-(-s[0] // world) * s[1:].numel() if len(s) else 1 for s in shapes]
        buckets = values.module_state.buckets
        self.sizes = {
            "rows": sum(rows),
            "bucket": max(b.padded_numel for b in buckets),
            "model": sum(map(math.prod, shapes)),
        }


def strategy_of(name: str, options: dict[str, Any]) -> Any:
    return "ddp" if name == "ddp" else ZeroStrategy(**{"bucket_numel": 2_000, **options})


def _trainer(strategy: Any, steps: int, precision: str, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def saved_model_state(path: str) -> dict[str, Tensor] | None:
    """The model's state a checkpoint holds, as DDP's file holds it (a sharded one consolidated); rank 0 only."""
    if dist.get_rank() != 0:
        return None
    if os.path.isdir(path):
        path = str(consolidate_checkpoint(path, path + ".pt"))
    state: dict[str, Tensor] = torch.load(path, weights_only=True, map_location="cpu")["state_dict"]
    return state


def save_with_hooks(name: str, options: dict[str, Any], precision: str, model: Any, root: str) -> dict[str, Any]:
    """Fit ``STEPS`` steps under ``name`` ("ddp" or "zero" with ``options``), with ``SaveHooks`` and ``HalfHook``
    editing the checkpoint saved at the end; what the hooks saw and what the file holds."""
    module = model()
    hooks = SaveHooks()
    before, after = Probe(), Probe()  # around the hooks: what handing the entries out read, what the hooks did
    left = Left()
    saves = ModelCheckpoint(dirpath=f"{root}/{name}", filename="{step}", every_n_train_steps=STEPS, save_top_k=-1)
    callbacks = [before, hooks, HalfHook(), after, left, saves]
    _trainer(strategy_of(name, options), STEPS, precision, callbacks).fit(module)
    path = f"{root}/{name}/step={STEPS}.ckpt"
    return {
        "types": sorted(hooks.types),
        "norms": hooks.norms,
        "saved": saved_model_state(path),
        "left": left.left,
        "kept": (before.kept, after.kept, after.sizes),
    }


def in_place_refused(options: dict[str, Any], root: str) -> dict[str, Any]:
    """A hook that writes into an entry in place: the error on each rank, and whether anything was written."""
    path = f"{root}/in-place"
    saves = ModelCheckpoint(dirpath=path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    error = None
    try:
        _trainer(strategy_of("zero", options), 1, "32-true", [SaveHooks(in_place=True), saves]).fit(LoggedGPT())
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    dist.barrier()
    return {"error": error, "written": sorted(p.name for p in Path(path).glob("*")) if os.path.isdir(path) else []}


class RankZeroEdits(pl.Callback):
    """A hook under ``rank_zero_only`` that drops, renames and replaces entries on rank 0 alone."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.global_rank == 0:
            state = checkpoint["state_dict"]
            del state["frozen"]
            state["renamed.wpe"] = state.pop("model.wpe.weight")
            state["model.ln_f.weight"] = torch.full(pl_module.model.ln_f.weight.shape, 0.25)


def rank_zero_edits(name: str, root: str) -> dict[str, Tensor] | None:
    """What a save holds after ``RankZeroEdits`` (rank 0)."""
    saves = ModelCheckpoint(dirpath=f"{root}/rank0-{name}", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    _trainer(strategy_of(name, {"stage": 3}), 1, "32-true", [RankZeroEdits(), saves]).fit(LoggedGPT())
    return saved_model_state(f"{root}/rank0-{name}/step=1.ckpt")


def resume_renamed(name: str, options: dict[str, Any], root: str) -> dict[str, Any]:
    """Fit 4 steps reading every entry at each save; resume at step 2 into the model with its child renamed, whose
    ``on_load_checkpoint`` maps the keys; then a resume without the mapping (strict loading refuses it)."""
    first = LoggedGPT()
    norms = NormHook()
    saves = ModelCheckpoint(dirpath=f"{root}/{name}", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    _trainer(strategy_of(name, options), 4, "32-true", [norms, saves]).fit(first)
    ckpt = f"{root}/{name}/step=2.ckpt"
    resumed = RenamedGPT()
    _trainer(strategy_of(name, options), 4, "32-true", []).fit(resumed, ckpt_path=ckpt)
    refused = None
    try:
        _trainer(strategy_of(name, options), 3, "32-true", []).fit(RenamedGPT(remap=False), ckpt_path=ckpt)
    except Exception as failure:
        refused = f"{type(failure).__name__}: {failure}"
    replaced = RenamedGPT(replace="every")  # one step on: the entry written into keeps its optimizer state
    _trainer(strategy_of(name, options), 3, "32-true", []).fit(replaced, ckpt_path=ckpt)
    new: dict[str, Tensor] | str  # a new tensor in place of the moved entry: DDP's state follows by position
    try:
        _trainer(strategy_of(name, options), 3, "32-true", []).fit(
            renamed_new := RenamedGPT(replace="new"), ckpt_path=ckpt
        )
        new = weights(renamed_new)
    except Exception as failure:
        new = f"{type(failure).__name__}: {failure}"
    halved = RenamedGPT(replace="half")  # validate restores under inference mode; the hook reads the saved values
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(5))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    _trainer(strategy_of(name, options), 2, "32-true", []).validate(halved, data, ckpt_path=ckpt)
    rank_zero = None  # DDP would load different weights on each rank; ZeRO refuses
    if name == "zero":
        try:
            _trainer(strategy_of(name, options), 3, "32-true", []).fit(RenamedGPT(replace="rank0"), ckpt_path=ckpt)
        except Exception as failure:
            rank_zero = f"{type(failure).__name__}: {failure}"
    loaded = None  # a one-file checkpoint: Lightning's load_from_checkpoint runs the hook itself (rank 0)
    if os.path.isfile(ckpt) and dist.get_rank() == 0:
        loaded = {k: v.clone() for k, v in RenamedGPT.load_from_checkpoint(ckpt).state_dict().items()}
    return {
        "loaded": loaded,
        "losses": first.losses,
        "resumed": resumed.losses,
        "final": weights(first),
        "final_resumed": weights(resumed),
        "norms": norms.norms,
        "refused": refused,
        "replaced": weights(replaced),
        "validated": halved.validated,
        "new": new,
        "rank_zero_refused": rank_zero,
    }


class EmaState:
    """An average of the weights kept as a stateful object, as a Fabric loop keeps one: ``state_dict()`` gives its
    tensors (at stage 3 DTensors, taken from ``model.state_dict()``)."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def update(self, model: nn.Module) -> None:
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                value = value.detach()
                self.values[key] = value.clone() if key not in self.values else self.values[key] * 0.5 + value * 0.5

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.values = dict(state)


def fabric_stateful(name: str, root: str) -> dict[str, Any] | None:
    """A Fabric loop saving its model, optimizer and a stateful average (``fabric.save``), and loading the average
    alone into a fresh object (``fabric.load``): what the object got back (rank 0)."""
    from lightning.fabric import Fabric

    from lightning_zero.models.gpt import GPT, GPTConfig

    fabric = Fabric(strategy="ddp" if name == "ddp" else "zero3", accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(1234)
    model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema = EmaState()
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(fabric.global_rank))
    for _ in range(2):
        logits = model(tokens[:, :-1])
        fabric.backward(nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
    path = f"{root}/fabric-{name}.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "ema": ema})
    loaded = EmaState()
    fabric.load(path, {"ema": loaded}, strict=False)
    if fabric.global_rank != 0:
        return None
    return {"types": sorted({type(v).__name__ for v in loaded.values.values()}), "ema": loaded.values}
