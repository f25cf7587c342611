"""``fabric.load_raw``: a raw state-dict file (or a sharded directory's weights, or pretrained weights) loaded into
one set-up object, and the strategy state every load reads and sets: whether a model built on meta has had weights
loaded, and where its frozen base came from (Note [frozen base restored from its source] in
``checkpoint/frozen.py``). ``checkpoint.py`` loads whole checkpoints through these."""

from __future__ import annotations

from os import PathLike
from typing import Any, Protocol

import torch.distributed as dist
from torch.nn import Module

from lightning_zero.checkpoint.files import CheckpointError, load_lightning_state
from lightning_zero.checkpoint.frozen import FROZEN_KEY, source_path
from lightning_zero.checkpoint.full_weights import load_pretrained
from lightning_zero.checkpoint.pretrained import is_pretrained_source
from lightning_zero.checkpoint.sharded_checkpoint import load_checkpoint, load_full_checkpoint
from lightning_zero.checkpoint.storage import locate
from lightning_zero.fabric.models import SetUpModel, SetUpModels
from lightning_zero.offload.memory_tiers import MemoryTiers

CheckpointPath = str | PathLike[str]
"""A checkpoint's location: a local path or an fsspec URL."""


class LoadingStrategy(Protocol):
    """What these functions use of ``ZeroFabricStrategy`` (``strategy.py``, through ``checkpoint.py``)."""

    pretrained_source: str | None
    """Set by a load of pretrained weights or of a checkpoint that left the frozen base out."""

    @property
    def models(self) -> SetUpModels: ...
    @property
    def _tiers(self) -> MemoryTiers | None: ...
    @property
    def process_group(self) -> dist.ProcessGroup: ...


def load_pretrained_weights(
    strategy: LoadingStrategy, path: CheckpointPath, state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """``fabric.load(path, {name: model})`` of weights only (a Hugging Face directory), as the Trainer's
    ``fit(ckpt_path=hf_dir)``: one set-up model, loaded as ``fabric.load_raw`` loads it."""
    models = [m for m in (strategy.models.of(o) for o in state.values()) if m is not None]
    if len(models) != 1 or len(state) != 1:
        raise CheckpointError(
            f"{path} holds pretrained weights of one model, and `state` holds {list(state)}. HINT: "
            "`fabric.load_raw(path, model)`, or `fabric.load(path, {'model': model})`."
        )
    load_raw(strategy, path, models[0].module, strict)
    return {}


def unloaded_meta(strategy: LoadingStrategy, model: SetUpModel) -> bool:
    """Built on meta and only initialized: nothing loaded into it yet."""
    return model.built_on_meta and strategy.pretrained_source is None


def note_frozen_source(strategy: LoadingStrategy, loaded: dict[str, Any]) -> None:
    """A checkpoint whose frozen base came from a pretrained source: so did this run's, and its saves say so."""
    frozen = loaded.get(FROZEN_KEY)
    if isinstance(frozen, dict) and frozen.get("source") is not None:
        strategy.pretrained_source = frozen["source"]


def load_raw(strategy: LoadingStrategy, path: CheckpointPath, obj: Any, strict: bool) -> None:
    """``fabric.load_raw(path, obj)``. A set-up model takes a full state-dict file (``torch.save(model.state_dict())``,
    or a Lightning checkpoint, a ``.safetensors`` file or a Hugging Face directory), streamed into its shards
    (``load_full_state_dict``), or a sharded directory's weights; a set-up optimizer takes a torch optimizer's
    ``state_dict()`` file, by parameter position as DDP's does; anything not set up loads the file as under Fabric's
    DDP."""
    location = locate(path)
    model = strategy.models.of(obj)
    zero = strategy.models.optimizer(obj)
    if model is None and zero is None:
        if _is_directory(path):
            raise CheckpointError(
                f"{path} is a directory, and `fabric.load_raw` got a {type(obj).__name__} that was not set up, which "
                "loads one file. HINT: load a sharded checkpoint into set-up objects, `fabric.load(path, state)`."
            )
        contents = load_lightning_state(location, mmap=True)
        if isinstance(obj, Module):
            obj.load_state_dict(contents, strict=strict)
        else:
            obj.load_state_dict(contents)
        return
    if zero is not None:
        owner = strategy.models.model_of(zero)
        optimizer_states = [load_lightning_state(location) if o is zero else None for o in owner.optimizers]
        full_state = {"state_dict": {}, "optimizer_states": optimizer_states}
        load_full_checkpoint(
            full_state, location, owner.module, owner.optimizers, load_optimizer=True, strict=False,
            gatherer=owner.gatherer, tiers=strategy._tiers, built_on_meta=False,
        )  # fmt: skip
        return
    assert model is not None
    if _is_directory(path) and not is_pretrained_source(location):  # a sharded checkpoint, not a HF directory
        loaded = load_checkpoint(
            path,
            model.module,
            model.optimizers,
            strategy.process_group,
            load_optimizer=False,
            strict=strict,
            gatherer=model.gatherer,
            tiers=strategy._tiers,
            built_on_meta=unloaded_meta(strategy, model),
        )
        note_frozen_source(strategy, loaded)
        return
    # A torch.save file, a .safetensors file or a Hugging Face directory: its keys under the prefix that names the
    # model's entries (found, e.g. none for the model itself), each rank reading only its ranges.
    load_pretrained(model.module, path, model.optimizers, model.gatherer, prefix=None, strict=strict,
                    tiers=strategy._tiers)  # fmt: skip
    # The frozen base came from here: checkpoints that leave it out record it (Note [frozen base restored from its
    # source]).
    strategy.pretrained_source = source_path(path)


def _is_directory(path: CheckpointPath) -> bool:
    location = locate(path)
    return location.exists() and not location.isfile()
