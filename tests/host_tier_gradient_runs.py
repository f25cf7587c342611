"""Runs for ``tests/test_host_tier_gradients.py``: loops that read ``.grad`` between backward and the step (a Fabric
loop after ``fabric.backward``, before and after ``fabric.clip_gradients``; the Trainer's ``on_before_optimizer_step``)
with the optimizer in the host tier, on its copy path (``FORCE_COPIES``: separate host masters and gradients, as on an
accelerator, Note [host tier data path]), where ``.grad`` is read from the reduced device shards (Note [gradients
visible to hooks]); the same loops under DDP are the oracle. Inside ranks started by ``tests.harness.run_distributed``
with ``init_process_group=False``."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import ZeroStrategy
from lightning_zero.compat import tree_map
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from tests.fabric_gradient_runs import build, reads
from tests.lightning_port_fabric_runs import batch, loss_of, make_fabric, strategy_for, weights
from tests.offload_runs import forced_host_copies

STEPS = 3
CLIP = 0.05
"""Below every step's gradient norm: each clip scales the gradients (checked by the test)."""


def fabric_loop(
    name: str, precision: str, fields: dict[str, Any], read: bool = True, accelerator: str = "cpu", devices: int = 2
) -> dict[str, Any]:
    """``STEPS`` AdamW steps of ``build()``, each clipped to ``CLIP``; ``read``: the loop's reads (``reads``) after
    ``fabric.backward`` and again after ``fabric.clip_gradients``."""
    strategy = strategy_for(name, **({} if name == "ddp" else fields))
    fabric = Fabric(strategy=strategy, accelerator=accelerator, devices=devices, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    module = build()
    model, optimizer = fabric.setup(
        module, torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.02)
    )
    steps: list[dict[str, Any]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(fabric, model, optimizer, steps, read)
    shown_warnings = [str(w.message) for w in caught if "`.grad`" in str(w.message)]
    return {"steps": steps, "weights": weights(fabric, model), "warnings": shown_warnings}


def _steps(fabric: Any, model: Any, optimizer: Any, steps: list[dict[str, Any]], read: bool) -> None:
    for step in range(STEPS):
        fabric.backward(loss_of(model, fabric.to_device(batch(fabric.global_rank, step))))
        before = reads(model) if read else {}
        norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        after = reads(model) if read else {}
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"before": before, "clip_norm": torch.as_tensor(norm).detach().clone(), "after": after})


def fabric_runs(
    precision: str,
    variants: dict[str, tuple[str, dict[str, Any]]],
    disk_root: str | None = None,
    accelerator: str = "cpu",
    devices: int = 2,
) -> dict[str, dict[str, Any]]:
    """Fabric's DDP, then each ``{label: (strategy name, fields)}`` on the host tier's copy path; a label ending in
    ``-unread`` runs without the reads. ``disk_root``: also stage 3 with the optimizer and its gradients on disk
    there (``"disk"``), whose gradients are not shown. Tensors come back on the CPU."""
    out = {"ddp": fabric_loop("ddp", precision, {}, accelerator=accelerator, devices=devices)}
    with forced_host_copies():
        for label, (name, fields) in variants.items():
            read = not label.endswith("-unread")
            out[label] = fabric_loop(name, precision, fields, read, accelerator, devices)
    if disk_root is not None:
        out["disk"] = disk_loop(precision, disk_root)
    return _on_cpu(out)


def _on_cpu(results: Any) -> Any:
    return tree_map(lambda x: x.cpu() if isinstance(x, Tensor) else x, results)


def disk_loop(precision: str, root: str) -> dict[str, Any]:
    """``fabric_loop`` at stage 3 with the optimizer and the gradients on disk: after each ``fabric.backward``, what
    ``.grad`` is (None, or the refusal of a read) instead of the reads."""
    fabric = make_fabric("zero3", precision, offload_optimizer="disk", offload_dir=root)
    module = build()
    model, optimizer = fabric.setup(
        module, torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.02)
    )
    shown: list[dict[str, str | None]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            fabric.backward(loss_of(model, batch(fabric.global_rank, step)))
            shown.append({n: None if p.grad is None else _refusal(p.grad) for n, p in model.named_parameters()})
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
    shown_warnings = [str(w.message) for w in caught if "`.grad`" in str(w.message)]
    return {"shown": shown, "weights": weights(fabric, model), "warnings": shown_warnings}


def _refusal(grad: Tensor) -> str:
    try:
        torch.linalg.vector_norm(grad)
    except RuntimeError as error:
        return str(error)
    return "read"


class Plain(pl.LightningModule):
    """A small MLP (one layer unused, as DDP's ``find_unused_parameters`` case) trained by AdamW, clipped to ``CLIP``
    in ``configure_gradient_clipping``, which records the total norm the clip took (ZeRO's from the tier's host
    copies)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.unused = nn.Linear(2, 2)
        self.lightning_norms: list[dict[str, Tensor]] = []
        self.norms: list[dict[str, Tensor]] = []
        self.copies: list[Tensor] = []
        self.clip_norms: list[Tensor] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, ZeroOptimizer):
            norm = inner.clip_grad_norm_(CLIP)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)
        self.clip_norms.append(norm.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4 * 2 * STEPS, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] * 2 - x[:, 1:2]), batch_size=4)


class Reading(Plain):
    """``Plain`` recording, in ``on_before_optimizer_step``, Lightning's ``grad_norm`` of ``.grad``,
    ``lightning_zero.grad_norm`` and a copy of one gradient."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lightning_norms.append(lightning_grad_norm(self, 2))
        self.norms.append(lightning_zero.grad_norm(self, 2))
        grad = self.body[0].weight.grad
        assert grad is not None
        self.copies.append(grad.clone())


def _fit(
    strategy: Any, root: str, precision: str, read: bool = True, accelerator: str = "cpu", devices: int = 2
) -> dict[str, Any]:
    module = Reading() if read else Plain()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=accelerator,
        devices=devices,
        max_epochs=1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,  # type: ignore[arg-type]
    )
    trainer.fit(module)
    with trainer.strategy.gathered_parameters() if isinstance(trainer.strategy, ZeroStrategy) else nullcontext():
        final = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    return {
        "lightning_norms": module.lightning_norms,
        "norms": module.norms,
        "copies": module.copies,
        "clip_norms": module.clip_norms,
        "weights": final,
    }


def trainer_runs(
    root: str, precision: str, variants: dict[str, dict[str, Any]], accelerator: str = "cpu", devices: int = 2
) -> dict[str, dict[str, Any]]:
    """The Trainer's DDP, then ``ZeroStrategy(**fields)`` of each ``{label: fields}`` on the host tier's copy
    path; a label ending in ``-unread`` trains ``Plain``, which reads nothing."""
    out = {"ddp": _fit("ddp_find_unused_parameters_true", root, precision, True, accelerator, devices)}
    with forced_host_copies():
        for label, fields in variants.items():
            strategy = ZeroStrategy(bucket_numel=100, **fields)
            out[label] = _fit(strategy, root, precision, not label.endswith("-unread"), accelerator, devices)
    return _on_cpu(out)
