"""Cases of Lightning's own Fabric strategy tests (``tests_fabric/test_fabric.py``,
``strategies/test_ddp_integration.py``, ``test_fsdp_integration.py``, ``test_model_parallel_integration.py``), written
for ``ZeroFabricStrategy`` and run
under Fabric's DDP too, where numbers are the oracle. Everything here runs inside ranks started by
``tests.harness.run_distributed`` with ``init_process_group=False``: each case builds its own ``Fabric`` (Fabric
reuses the process group the first one created).

``battery`` runs every case under every strategy in one set of processes (the suite's budget) and returns, per case
and strategy, what it measured or the traceback it raised, so one failing case does not hide the others.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch import Tensor, nn

from lightning_zero import ZeroFabricStrategy

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
"""The control first: every ZeRO result is compared with Fabric's DDP."""

Result = dict[str, Any]


def strategy_for(name: str, **fields: Any) -> str | ZeroFabricStrategy:
    if name == "ddp":
        return "ddp"
    # Small buckets and one unit per Linear at stage 3, so parameters straddle ranks and units.
    stage = int(name[-1])
    return ZeroFabricStrategy(stage=stage, bucket_numel=40, wrap_min_numel=32, collective_timeout_s=30, **fields)


def make_fabric(name: str, precision: str = "32-true", **fields: Any) -> Fabric:
    fabric = Fabric(strategy=strategy_for(name, **fields), accelerator="cpu", devices=2, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def two_groups(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    """Adam with a param group per Linear, each with its own learning rate (over a set-up model's parameters too)."""
    layers = getattr(model, "module", model)
    first, second = layers[0].parameters(), layers[2].parameters()
    return torch.optim.Adam([{"params": first, "lr": lr}, {"params": second, "lr": lr / 2}])


def batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def loss_of(model: Any, data: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.mse_loss(model(data[0]), data[1])


def weights(fabric: Fabric, *models: Any) -> dict[str, Tensor]:
    """Every parameter of the set-up ``models`` in full on every rank, as ``<index>.<name>``."""
    strategy = fabric.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroFabricStrategy) else nullcontext()
    with context:
        return {
            f"{i}.{n}": p.detach().clone()
            for i, model in enumerate(models)
            for n, p in getattr(model, "module", model).named_parameters()
        }


def steps(fabric: Fabric, model: Any, optimizer: Any, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = loss_of(model, batch(fabric.global_rank, step))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# -- test_fabric.py: setup, setup_module + setup_optimizers, several models ------------------------------------------
def setup_orders(name: str, root: str) -> Result:
    """The three ways a loop sets up a model and its optimizer; each trains three steps."""
    result: Result = {}
    for order in ("joint", "optimizer_before_setup_module", "optimizer_after_setup_module"):
        fabric = make_fabric(name)
        raw = build()
        if order == "joint":
            model, optimizer = fabric.setup(raw, two_groups(raw))
        elif order == "optimizer_before_setup_module":
            optimizer = two_groups(raw)  # over the parameters the model had before it was set up
            model = fabric.setup_module(raw)
            optimizer = fabric.setup_optimizers(optimizer)
        else:
            model = fabric.setup_module(raw)
            optimizer = fabric.setup_optimizers(two_groups(model))
        wrapped = isinstance(model, _FabricModule) and isinstance(optimizer, _FabricOptimizer)
        same_module = model.module is raw
        groups = [(len(g["params"]), g["lr"]) for g in optimizer.param_groups]
        losses = steps(fabric, model, optimizer, 0, 3)
        refusals = []
        for again in (fabric.setup, fabric.setup_module):
            try:
                again(model)
            except ValueError as error:
                refusals.append(str(error))
        result[order] = {
            "wrapped": wrapped,
            "same_module": same_module,
            "groups": groups,
            "losses": losses,
            "weights": weights(fabric, model),
            "refusals": refusals,
            "models_setup": fabric._models_setup,
        }
    return result


def several_models(name: str, root: str) -> Result:
    """Two models set up one by one, their optimizers together (``setup_optimizers(opt0, opt1)``), trained on one
    loss through both."""
    fabric = make_fabric(name)
    first, second = build(0), build(1)
    first_optimizer = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    second_optimizer = torch.optim.Adam(second.parameters(), lr=0.01)
    first, second = fabric.setup_module(first), fabric.setup_module(second)
    first_optimizer, second_optimizer = fabric.setup_optimizers(first_optimizer, second_optimizer)
    losses = []
    for step in range(3):
        inputs, targets = batch(fabric.global_rank, step)
        loss = nn.functional.mse_loss(first(inputs) + second(inputs), targets)
        fabric.backward(loss)
        for optimizer in (first_optimizer, second_optimizer):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": weights(fabric, first, second)}


# -- init_module(empty_init=...) -----------------------------------------------------------------------------------
def init_module(name: str, root: str) -> Result:
    """Where ``fabric.init_module`` builds the model and where it is after setup (Lightning's
    ``test_module_init_context``), the weights it starts from, and the dtype under ``bf16-true``."""
    result: Result = {}
    for precision in ("32-true", "bf16-true"):
        fabric = make_fabric(name, precision)
        for empty_init in (False, True):
            torch.manual_seed(0)
            with fabric.init_module(empty_init=empty_init):
                model = nn.Linear(32, 16)
            before = (str(model.weight.device), model.weight.dtype)
            model = fabric.setup(model)
            after = [(str(p.device), p.dtype) for p in model.parameters()]
            result[(precision, empty_init)] = {"before": before, "after": after, "weights": weights(fabric, model)}
    return result


# -- fabric.save / fabric.load, strict, partial, filter, load_raw -------------------------------------------------
def save_and_load(name: str, root: str) -> Result:
    """Lightning's ``test_train_save_load``: train, save model, optimizer and a plain value, train on; a fresh model
    and optimizer loading the checkpoint train on to the same weights. Then the strict and partial loads."""
    directory = os.path.join(root, f"save_and_load-{name}")
    path = os.path.join(directory, "checkpoint")
    fabric = make_fabric(name)
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(two_groups(model))
    steps(fabric, model, optimizer, 0, 2)
    saved = weights(fabric, model)
    fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
    steps(fabric, model, optimizer, 2, 4)
    continued = weights(fabric, model)

    fabric = make_fabric(name)
    model = fabric.setup_module(build(seed=7))
    optimizer = fabric.setup_optimizers(two_groups(model, lr=1.0))  # the checkpoint's learning rates come back
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "steps": 0}
    remainder = fabric.load(path, state)
    loaded = weights(fabric, model)
    lrs = [g["lr"] for g in optimizer.param_groups]
    steps(fabric, model, optimizer, 2, 4)
    resumed = weights(fabric, model)

    result: Result = {
        "saved": saved,
        "loaded": loaded,
        "steps": state["steps"],
        "remainder": remainder,
        "lrs": lrs,
        "continued": continued,
        "resumed": resumed,
    }
    # A name the checkpoint lacks: Fabric's KeyError, unless strict=False (then the value stays)
    try:
        fabric.load(path, {"model": model, "coconut": 11})
        result["missing_key"] = None
    except KeyError as error:
        result["missing_key"] = str(error)
    lenient: dict[str, Any] = {"model": model, "coconut": 11}
    fabric.load(path, lenient, strict=False)
    result["coconut"] = lenient["coconut"]
    # Partial: the model alone, then the optimizer alone, then nothing (what is not a model or optimizer comes back)
    fresh = fabric.setup_module(build(seed=8))
    fabric.load(path, {"model": fresh})
    result["model_only"] = weights(fabric, fresh)
    result["everything_else"] = fabric.load(path)
    return result


def optimizer_only(name: str, root: str) -> Result:
    """A checkpoint's optimizer state alone into a fresh optimizer over the same weights: the next steps are those
    of the run that saved it."""
    path = os.path.join(root, f"optimizer_only-{name}", "checkpoint")
    fabric = make_fabric(name)
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(two_groups(model))
    steps(fabric, model, optimizer, 0, 2)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    steps(fabric, model, optimizer, 2, 4)
    continued = weights(fabric, model)
    fabric = make_fabric(name)
    model = fabric.setup_module(build(seed=3))
    optimizer = fabric.setup_optimizers(two_groups(model))
    fabric.load(path, {"model": model})
    fabric.load(path, {"optimizer": optimizer})
    steps(fabric, model, optimizer, 2, 4)
    return {"continued": continued, "resumed": weights(fabric, model)}


def save_filter(name: str, root: str) -> Result:
    """Lightning's ``test_save_filter``: ``filter={"model": fn}`` keeps the entries ``fn`` accepts, in one file
    (``state_dict_type="full"``, DDP's format) and in the sharded directory."""
    directory = os.path.join(root, f"save_filter-{name}")
    result: Result = {}
    fields = {} if name == "ddp" else {"state_dict_type": "full"}
    fabric = make_fabric(name, **fields)
    model = fabric.setup_module(build())
    file = os.path.join(directory, "full.pt")
    fabric.save(file, {"model": model}, filter={"model": lambda key, value: "bias" in key})
    result["file_keys"] = sorted(torch.load(file, weights_only=True)["model"])
    if name != "ddp":
        fabric = make_fabric(name)
        model = fabric.setup_module(build())
        sharded = os.path.join(directory, "sharded")
        fabric.save(sharded, {"model": model}, filter={"model": lambda key, value: "bias" in key})
        fresh = fabric.setup_module(build(seed=5))
        before = weights(fabric, fresh)
        try:
            fabric.load(sharded, {"model": fresh})
            result["strict_load"] = None
        except Exception as error:
            result["strict_load"] = f"{type(error).__name__}: {error}"
        fabric.load(sharded, {"model": fresh}, strict=False)
        after = weights(fabric, fresh)
        original = weights(fabric, model)
        result["lenient_load"] = {k: torch.equal(after[k], original[k] if "bias" in k else before[k]) for k in after}
    return result


def before_and_after_setup(name: str, root: str) -> Result:
    """Lightning's ``test_ddp_save_load``: a model saved before ``setup`` and after it, each loaded into a plain model
    and into a set-up one."""
    directory = os.path.join(root, f"before_after-{name}")
    fabric = make_fabric(name)
    model = build()
    expected = {f"0.{n}": p.detach().clone() for n, p in model.named_parameters()}
    before, after = os.path.join(directory, "before.ckpt"), os.path.join(directory, "after.ckpt")
    fabric.save(before, {"model": model})
    wrapped = fabric.setup(model)
    fabric.save(after, {"model": wrapped})
    result: Result = {"expected": expected}
    for saved in (before, after):
        plain = build(seed=9)
        try:
            fabric.load(saved, {"model": plain})
            loaded = {f"0.{n}": p.detach().clone() for n, p in plain.named_parameters()}
            result[(os.path.basename(saved), "plain")] = loaded
        except Exception:
            result[(os.path.basename(saved), "plain")] = traceback.format_exc()
        set_up = fabric.setup(build(seed=9))
        fabric.load(saved, {"model": set_up})
        result[(os.path.basename(saved), "set_up")] = weights(fabric, set_up)
    return result


def exchange_with_ddp(name: str, root: str) -> Result:
    """Lightning's ``test_save_full_state_dict`` and ``test_load_full_state_dict_into_sharded_model``: Fabric's DDP
    file into ZeRO, ZeRO's one file (``state_dict_type="full"``) into Fabric's DDP, a raw ``model.state_dict()`` file
    into the set-up model (``fabric.load_raw``), each followed by the same steps."""
    if name == "ddp":
        return {}
    directory = os.path.join(root, f"exchange-{name}")
    ddp_file, zero_file, raw_file = (os.path.join(directory, f) for f in ("ddp.pt", "zero.pt", "raw.pt"))
    result: Result = {}
    # Fabric's DDP trains and saves one file; ZeRO loads it and trains on, DDP does too
    fabric = make_fabric("ddp")
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(two_groups(model))
    steps(fabric, model, optimizer, 0, 2)
    fabric.save(ddp_file, {"model": model, "optimizer": optimizer, "steps": 2})
    result["ddp_saved"] = weights(fabric, model)
    if fabric.global_rank == 0:
        torch.save(model.module.state_dict(), raw_file)
    fabric.barrier()
    steps(fabric, model, optimizer, 2, 4)
    result["ddp_continued"] = weights(fabric, model)
    fabric = make_fabric(name)
    model = fabric.setup_module(build(seed=4))
    optimizer = fabric.setup_optimizers(two_groups(model))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "steps": 0}
    fabric.load(ddp_file, state)
    result["steps"] = state["steps"]
    steps(fabric, model, optimizer, 2, 4)
    result["zero_from_ddp"] = weights(fabric, model)
    # ZeRO saves one file as Fabric's DDP does; DDP loads it and trains on
    fabric = make_fabric(name, state_dict_type="full")
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(two_groups(model))
    steps(fabric, model, optimizer, 0, 2)
    fabric.save(zero_file, {"model": model, "optimizer": optimizer, "steps": 2})
    result["file_keys"] = sorted(torch.load(zero_file, weights_only=True))
    steps(fabric, model, optimizer, 2, 4)
    result["zero_continued"] = weights(fabric, model)
    fabric = make_fabric("ddp")
    model = fabric.setup_module(build(seed=4))
    optimizer = fabric.setup_optimizers(two_groups(model))
    fabric.load(zero_file, {"model": model, "optimizer": optimizer})
    steps(fabric, model, optimizer, 2, 4)
    result["ddp_from_zero"] = weights(fabric, model)
    # load_raw of a plain state-dict file
    fabric = make_fabric(name)
    model = fabric.setup_module(build(seed=4))
    fabric.load_raw(raw_file, model)
    result["load_raw"] = weights(fabric, model)
    return result


# -- no_backward_sync, clipping -------------------------------------------------------------------------------------
def no_backward_sync(name: str, root: str) -> Result:
    """Two micro-batches per step, the first under ``no_backward_sync``, then steps zeroed by
    ``model.zero_grad(set_to_none=False)``; and the ``TypeError`` for a model that was not set up."""
    fabric = make_fabric(name)
    raw = build()
    try:
        with fabric.no_backward_sync(raw):
            pass
        refusal = None
    except TypeError as error:
        refusal = str(error)
    model, optimizer = fabric.setup(raw, two_groups(raw))
    losses = []
    for step in range(3):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = loss_of(model, batch(fabric.global_rank, 2 * step + micro)) / 2
                fabric.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    for step in range(6, 9):  # the model's own zero_grad, keeping zero tensors as torch's default once did
        loss = loss_of(model, batch(fabric.global_rank, step))
        fabric.backward(loss)
        optimizer.step()
        model.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return {"refusal": refusal, "losses": losses, "weights": weights(fabric, model)}


def clipping(name: str, root: str) -> Result:
    """Lightning's ``test_clip_gradients``: a layer whose gradients are all equal, clipped by value to half of them
    and by norm to a tenth of their norm; SGD with learning rate 1 turns the clipped gradient into the weight
    change, which every strategy must make alike (the gradient of a sharded parameter is not read directly: it
    lives in the shards)."""
    result: Result = {}
    for kind in ("value", "norm"):
        fabric = make_fabric(name)
        layer = nn.Linear(32, 2, bias=False)
        layer.weight.data.fill_(0.01)
        model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=1.0))
        loss = model(torch.full((1, 32), 0.1)).sum()  # every gradient entry is 0.1
        fabric.backward(loss)
        grad_after_backward: Tensor | str | None = None
        if model.weight.grad is not None:  # what a loop reading gradients between backward and step finds
            try:
                grad_after_backward = model.weight.grad.clone()
            except RuntimeError as error:
                grad_after_backward = str(error)
        if kind == "value":
            norm = None
            fabric.clip_gradients(model, optimizer, clip_val=0.05)
        else:
            norm = float(fabric.clip_gradients(model, optimizer, max_norm=0.08))
        optimizer.step()
        optimizer.zero_grad()
        result[kind] = {"norm": norm, "weights": weights(fabric, model), "grad_after_backward": grad_after_backward}
    return result


# -- collectives ---------------------------------------------------------------------------------------------------
def collectives(name: str, root: str) -> Result:
    """``all_gather`` (a tensor, a dict of them), ``all_reduce`` (sum, mean), ``broadcast`` (an object, a tensor),
    ``barrier``, with a model set up (at stage 3, sharded) as a loop has one."""
    fabric = make_fabric(name)
    model = fabric.setup_module(build())
    rank = fabric.global_rank
    gathered = fabric.all_gather(torch.tensor([rank, 10 * rank]))
    gathered_dict = fabric.all_gather({"a": torch.tensor(rank + 1.0), "b": torch.ones(2) * rank})
    summed = fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum")
    mean = fabric.all_reduce(torch.tensor([rank + 1.0, 2.0 * rank]), reduce_op="mean")
    message = fabric.broadcast({"from": rank, "path": f"/tmp/rank{rank}"})
    tensor = fabric.broadcast(torch.arange(3) + rank, src=1)
    fabric.barrier()
    with torch.no_grad():
        output = model(torch.ones(2, 8))  # the model still works after the collectives
    return {
        "gathered": gathered,
        "gathered_dict": gathered_dict,
        "summed": summed,
        "mean": mean,
        "message": message,
        "tensor": tensor,
        "output": output,
    }


CASES: dict[str, Callable[[str, str], Result]] = {
    "setup_orders": setup_orders,
    "several_models": several_models,
    "init_module": init_module,
    "save_and_load": save_and_load,
    "optimizer_only": optimizer_only,
    "save_filter": save_filter,
    "before_and_after_setup": before_and_after_setup,
    "exchange_with_ddp": exchange_with_ddp,
    "no_backward_sync": no_backward_sync,
    "clipping": clipping,
    "collectives": collectives,
}


def battery(root: str, cases: list[str] | None = None, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """Every case under every strategy: ``{case: {strategy: result or traceback text}}``. The root directory is
    rank 0's; every rank writes under it (the harness's ranks share a machine)."""
    results: dict[str, Any] = {}
    for case in cases or list(CASES):
        results[case] = {}
        for name in strategies:
            try:
                results[case][name] = CASES[case](name, root)
            except Exception:
                results[case][name] = traceback.format_exc()
    return results
