"""Fabric loops for the Fabric front door's tests: the same loop under Fabric's DDP (the oracle) and under
``Fabric(strategy="zero*")``. Everything here runs inside a rank started by ``tests.harness.run_distributed`` with
``init_process_group=False``: Fabric creates the process group from the environment the harness sets."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch import Tensor, nn

from lightning_zero import ZeroFabricStrategy
from lightning_zero.models.mlp import MLP
from tests import parity, third_party_models
from tests.parity import Run

Fixture = tuple[Callable[[], nn.Module], Callable[[int, int], Any], Callable[[nn.Module, Any], Tensor]]


def fixture(name: str) -> Fixture:
    """(build the model, (rank, micro-batch index) -> batch, loss) for ``name``."""
    if name == "mlp":
        return (
            lambda: parity.build_model("mlp"),
            lambda rank, i: parity.batch("mlp", rank, i, 0),
            lambda model, data: parity.loss_fn("mlp", model, data),
        )
    if name == "gpt":
        return (
            lambda: parity.build_model("gpt"),
            lambda rank, i: parity.batch("gpt", rank, i, 0),
            lambda model, data: parity.loss_fn("gpt", model, data),
        )
    built = {"hf_causal_lm": third_party_models.hf_causal_lm, "hf_lora": third_party_models.hf_lora}[name]
    return (lambda: built().model, third_party_models._token_batch, third_party_models._hf_loss)


def make_fabric(strategy: str | ZeroFabricStrategy, precision: str = "32-true", devices: int = 2) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=devices, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with two param groups; SGD for the MLP (bf16's tolerances are SGD's: tests/test_precision.py); AdamW
    over the trainable parameters of a peft model."""
    if _is_peft(model):
        return _trainable_adamw(model)
    return parity.build_optimizer("sgd" if isinstance(model, MLP) else "adamw", model)


def _is_peft(model: nn.Module) -> bool:
    return any("lora_" in n for n, _ in model.named_parameters())


def _trainable_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)


def weights(fabric: Fabric, model: Any) -> dict[str, Tensor]:
    """Every parameter in full, on every rank (stage 3 gathers them for the copy)."""
    strategy = fabric.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroFabricStrategy) else nullcontext()
    with context:
        return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}


def train(
    strategy: str | ZeroFabricStrategy,
    name: str,
    steps: int,
    accumulate: int,
    max_norm: float | None,
    precision: str = "32-true",
    separate_setup: bool = False,
    init_module: bool = False,
    two_optimizers: bool = False,
    clip_val: float | None = None,
) -> Run:
    """``steps`` optimizer steps of ``accumulate`` micro-batches (all but the last under ``no_backward_sync``), with
    clipping by value when ``clip_val``, then by norm when ``max_norm``; the norms clipped by are in
    ``extra["norms"]``. The learning rates are set by hand every step."""
    fabric = make_fabric(strategy, precision)
    build, batch, loss_fn = fixture(name)
    stage3 = isinstance(strategy, ZeroFabricStrategy) and strategy.config.stage == 3
    context = fabric.init_module(empty_init=stage3) if init_module else nullcontext()  # stage 3: on meta
    with context:
        model = build()
    make = _two_optimizers if two_optimizers else lambda raw: [optimizer_for(raw)]
    if separate_setup:  # the optimizers are built over the set-up (at stage 3: sharded) model's parameters
        raw = model
        model = fabric.setup_module(model)
        optimizers = fabric.setup_optimizers(*make(raw))
        optimizers = list(optimizers) if isinstance(optimizers, tuple) else [optimizers]
    else:
        model, *optimizers = fabric.setup(model, *make(model))
    run = Run(extra={"norms": []})
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = loss_fn(model, batch(fabric.global_rank, step * accumulate + micro)) / accumulate
                fabric.backward(loss)
            total += loss.item()
        for optimizer in optimizers:
            for group in optimizer.param_groups:  # a warm-up set by hand every step, as LitGPT's loop does
                group["lr"] = group.setdefault("peak_lr", group["lr"]) * (step + 1) / steps
            if clip_val is not None:
                fabric.clip_gradients(model, optimizer, clip_val=clip_val)
            if max_norm is not None:
                run.extra["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=max_norm)))
            optimizer.step()
            optimizer.zero_grad()
        run.losses.append(total)
    run.weights = weights(fabric, model)
    return run


def _two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW over the transformer blocks, SGD with momentum over the rest (embeddings, final norm)."""
    blocks = [p for n, p in model.named_parameters() if ".blocks." in f".{n}"]
    rest = [p for n, p in model.named_parameters() if ".blocks." not in f".{n}"]
    return [torch.optim.AdamW(blocks, lr=3e-3), torch.optim.SGD(rest, lr=0.05, momentum=0.9)]


def ddp_and_zero(
    stage: int | dict[str, Any],
    name: str,
    steps: int,
    accumulate: int,
    max_norm: float | None,
    precision: str = "32-true",
) -> list[Run]:
    """One rank's [Fabric DDP run, Fabric ZeRO run] in ``precision``; ``stage``, or ``ZeroConfig`` fields. Stage 3
    sets up the model and the optimizer separately (as Fabric's FSDP needs), stages 1 and 2 together."""
    reference = ddp_only(name, steps, accumulate, max_norm, precision)
    return [reference, zero_only(stage, name, steps, accumulate, max_norm, precision)]


def ddp_only(name: str, steps: int, accumulate: int, max_norm: float | None, precision: str = "32-true") -> Run:
    """``ddp_and_zero``'s Fabric DDP run alone: a reference several ZeRO configurations can share."""
    return train("ddp", name, steps, accumulate, max_norm, precision)


def zero_only(
    stage: int | dict[str, Any],
    name: str,
    steps: int,
    accumulate: int,
    max_norm: float | None,
    precision: str = "32-true",
) -> Run:
    """``ddp_and_zero``'s Fabric ZeRO run alone."""
    fields = {"stage": stage} if isinstance(stage, int) else stage
    zero = ZeroFabricStrategy(bucket_numel=3_000, **fields)
    return train(zero, name, steps, accumulate, max_norm, precision, separate_setup=fields["stage"] == 3)


def built_on_meta_and_two_optimizers(stage: int) -> list[Run]:
    """[Fabric DDP, ZeRO]: the GPT built under ``fabric.init_module`` (on meta at stage 3) and set up together with
    two optimizers (``fabric.setup(model, opt1, opt2)``), with accumulation and clipping by value and by norm."""
    options: dict[str, Any] = {"init_module": True, "two_optimizers": True, "clip_val": 0.01}
    reference = train("ddp", "gpt", 3, 2, 0.5, **options)
    zero = ZeroFabricStrategy(stage=stage, bucket_numel=3_000)
    return [reference, train(zero, "gpt", 3, 2, 0.5, **options)]


def several(cases: list[tuple[Any, ...]]) -> list[list[Run]]:
    """``ddp_and_zero`` for each case, in one set of processes."""
    return [ddp_and_zero(*case) for case in cases]


def batch_norm_loop(strategy: str | ZeroFabricStrategy) -> tuple[list[float], list[Tensor]]:
    """A BatchNorm model whose ranks see differently scaled data, accumulating over two micro-batches, evaluated
    after every step: the losses, evaluations and final running statistics show whose buffers each forward used
    (Note [buffers follow rank 0] in ``lightning_zero/engine/buffers.py``)."""
    fabric = make_fabric(strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    values = []
    for _ in range(4):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(torch.randn(6, 8, generator=generator) * (1 + fabric.global_rank)).pow(2).mean()
                fabric.backward(loss)
            values.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            values.append(model(torch.ones(2, 8)).sum().item())
        model.train()
    return values, [b.clone() for b in model.module.buffers()]


def batch_norm_runs() -> list[tuple[list[float], list[Tensor]]]:
    return [batch_norm_loop(s) for s in ("ddp", ZeroFabricStrategy(stage=1), ZeroFabricStrategy(stage=3))]


def fp16_loop(strategy: str | ZeroFabricStrategy, steps: int = 6) -> tuple[list[float], float]:
    """The MLP in ``16-mixed`` on the CPU (Fabric's plugin with a CPU ``GradScaler``, which the connector would turn
    into bf16 when asked by name), clipped: the losses and the final loss scale. ZeRO translates the plugin into
    its own, keeping the scaler's schedule."""
    # A scale so large that the first steps overflow and are skipped, until it has backed off enough.
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**24))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, plugins=[plugin])  # type: ignore[arg-type]
    fabric.launch()
    model = parity.build_model("mlp")
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    zero = isinstance(fabric.strategy, ZeroFabricStrategy)
    losses = []
    for step in range(steps):
        loss = parity.loss_fn("mlp", model, parity.batch("mlp", fabric.global_rank, step, 0))
        fabric.backward(loss)
        # Fabric's DDP raises for the infinite norm of a step its scaler will skip; ZeRO skips it without a word.
        fabric.clip_gradients(model, optimizer, max_norm=0.5, error_if_nonfinite=zero)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    precision: Any = fabric.strategy.precision
    return losses, float(precision.loss_scaler.scale if zero else precision.scaler.get_scale())


def fp16_runs() -> list[tuple[list[float], float]]:
    return [fp16_loop("ddp"), fp16_loop(ZeroFabricStrategy(stage=2)), fp16_loop(ZeroFabricStrategy(stage=3))]
