"""``estimate --model``'s models: a LightningModule class path with its init args (as LightningCLI takes them), or a
config of ``conf/model/``; one training micro-batch for it; and its predicted peak per rank at each stage.

    python -m lightning_zero estimate --model my_project.LitLlama --model.hidden=4096 --gpus 8 --stage 3
    python -m lightning_zero estimate --model my_project.LitLlama --data my_project.TextData --data.batch_size=4 ...

The module is instantiated as LightningCLI would (``--model.KEY=VALUE`` or ``--model.init_args.KEY=VALUE``, values
read as YAML), its ``configure_model`` runs on the meta device, and its micro-batch is the first batch of the
training loader: the data module's (``--data``, after its ``setup("fit")``) or the module's own
``train_dataloader()``; ``--micro-batch`` re-batches it to that many samples. Nothing is allocated but the batch.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import yaml
from torch import Tensor

from lightning_zero.compat import tree_map_only
from lightning_zero.config import ZeroConfig
from lightning_zero.models.lightning_gpt import LitGPT
from lightning_zero.planning.auto_config import candidates, decide, format_decision, local_budget
from lightning_zero.planning.module_step import predict_lightning_module
from lightning_zero.planning.peak import PeakPrediction
from lightning_zero.trainer.precision import ZeroPrecision

TRAINING_PRECISION: dict[str, Literal["32-true", "bf16-mixed", "16-mixed"]] = {
    "fp32": "32-true",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
}
"""``--precision`` as the Trainer's ``precision`` the prediction runs the step under."""


def is_class_path(name: str) -> bool:
    return "." in name


def init_args(extra: Sequence[str], prefix: str) -> dict[str, Any]:
    """``--<prefix>.KEY=VALUE``, ``--<prefix>.KEY VALUE`` and ``--<prefix>.init_args.KEY=VALUE`` of ``extra``, values
    read as YAML (``4096`` an int, ``true`` a bool, ``[a, b]`` a list). Anything else is an error naming it."""
    args: dict[str, Any] = {}
    items = list(extra)
    while items:
        item = items.pop(0)
        head = f"--{prefix}."
        if not item.startswith(head):
            continue
        key, has_value, value = item[len(head) :].partition("=")
        if not has_value:
            if not items:
                raise ValueError(f"{item} has no value. HINT: write {item}=VALUE.")
            value = items.pop(0)
        key = key.removeprefix("init_args.")
        args[key] = yaml.safe_load(value)
    return args


def unknown_arguments(extra: Sequence[str]) -> list[str]:
    """What ``init_args`` would not read: not ``--model.*``/``--data.*`` nor the value after one without ``=``."""
    unknown, skip = [], False
    for item in extra:
        if skip:
            skip = False
            continue
        if item.startswith(("--model.", "--data.")):
            skip = "=" not in item
            continue
        unknown.append(item)
    return unknown


def load_class(path: str, kind: type) -> type:
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"Cannot import {path!r}: {error}. HINT: pass the class as `package.module.ClassName`, importable from "
            "where the command runs (PYTHONPATH)."
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, kind)):
        raise ValueError(f"{path!r} is not a {kind.__name__} subclass.")
    return cls


def instantiate(path: str, args: dict[str, Any]) -> pl.LightningModule:
    cls = load_class(path, pl.LightningModule)
    try:
        module: pl.LightningModule = cls(**args)
    except TypeError as error:
        raise ValueError(f"{path}({', '.join(f'{k}={v!r}' for k, v in args.items())}) failed: {error}") from error
    return module


def micro_batch(module: pl.LightningModule, data_path: str | None, data_args: dict[str, Any], size: int | None) -> Any:
    """One training micro-batch of ``size`` samples (the loader's own batch size when None)."""
    if isinstance(module, LitGPT) and data_path is None:
        tokens = torch.zeros(size or 1, module.config.block_size, dtype=torch.long)  # conf/model/ GPTs: no loader
        return tokens, tokens
    if data_path is not None:
        data = load_class(data_path, pl.LightningDataModule)(**data_args)
        data.setup("fit")
        loader = data.train_dataloader()
    elif pl.utilities.model_helpers.is_overridden("train_dataloader", module):
        loader = module.train_dataloader()
    else:
        raise ValueError(
            f"{type(module).__name__} has no train_dataloader() to take a micro-batch from. HINT: pass the data "
            "module with --data package.module.DataModule (and its --data.KEY=VALUE init args)."
        )
    batch = next(iter(loader))
    if size is None:
        return batch
    return tree_map_only(Tensor, lambda t: _resize(t, size), batch)


def _resize(tensor: Tensor, size: int) -> Tensor:
    if tensor.dim() == 0:
        return tensor
    repeats = -(-size // tensor.shape[0])
    return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:size]


def predict_stages(
    module: pl.LightningModule,
    batch: Any,
    config: ZeroConfig,
    world_size: int,
    precision: str,
) -> list[PeakPrediction]:
    """The predicted peak of rank 0 at stages 1, 2 and 3 (Note [predicted peak]): ``config`` gives the rest."""
    plugin = ZeroPrecision(TRAINING_PRECISION[precision])
    with torch.device("meta"):
        module.configure_model()

    def context() -> AbstractContextManager[Any]:
        return plugin.forward_context() if plugin.param_dtype != torch.float32 else nullcontext()

    predictions = []
    for stage in (1, 2, 3):
        stage_config = _for_stage(config, stage)
        if stage_config is None:
            continue
        predictions.append(
            predict_lightning_module(
                module,
                batch,
                stage_config,
                world_size,
                torch.device("cpu"),
                plugin.param_dtype,
                plugin.fp32_masters,
                context,
            )
        )
    return predictions


def auto_decision(module: pl.LightningModule, batch: Any, config: ZeroConfig, args: Any) -> str:
    """``estimate --auto``: the decision ``stage="auto"`` makes for this model on ``--gpus`` ranks, printed."""
    config = dataclasses.replace(
        config,
        auto=True,
        offload_optimizer="none",
        offload_params="none",
        offload_dir=args.offload_dir,
        auto_device_budget=None if args.device_budget is None else int(args.device_budget),
        auto_host_budget=None if args.host_budget is None else int(args.host_budget),
    )
    plugin = ZeroPrecision(TRAINING_PRECISION[args.precision])
    with torch.device("meta"):
        module.configure_model()

    def context() -> AbstractContextManager[Any]:
        return plugin.forward_context() if plugin.param_dtype != torch.float32 else nullcontext()

    def predict(candidate: ZeroConfig) -> PeakPrediction:
        device = torch.device("cpu")
        return predict_lightning_module(
            module, batch, candidate, args.gpus, device, plugin.param_dtype, plugin.fp32_masters, context
        )

    ranks_per_node = args.ranks_per_node or args.gpus
    budget = local_budget(config, torch.device("cpu"), ranks_per_node, args.offload_dir)
    if args.device_budget is not None:  # a GPU's memory: the host tier is then memory of its own
        budget = budget._replace(host_is_device=False)
    decision = decide(predict, candidates(config, ranks_per_node, args.gpus), budget, config.auto_headroom)
    verdict = decision.refusal() if decision.chosen < 0 else format_decision(decision)
    return verdict


def _for_stage(config: ZeroConfig, stage: int) -> ZeroConfig | None:
    """``config`` at ``stage``, or None where it cannot be (parameters in a tier below stage 3)."""
    if stage < 3 and config.offload_params != "none":
        return None
    return dataclasses.replace(config, stage=stage)  # type: ignore[arg-type]
