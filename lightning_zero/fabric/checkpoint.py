"""Fabric's ``save``/``load``/``load_raw`` in the Trainer's sharded checkpoint format (``lightning_zero.checkpoint``).

Note [Fabric state in the Trainer's format]
A Fabric checkpoint is a dictionary of named objects (``{"model": model, "optimizer": optimizer, "step": 3}``);
the Trainer's holds the model under ``state_dict`` and the optimizers, in order, under ``optimizer_states``. A Fabric
save writes the set-up model's sharded state as ``state_dict`` and the optimizers' as ``optimizer_states`` (all of
them, in the order they were set up), everything else of the dictionary as it is (a ``state_dict()`` for stateful
objects), and under ``FABRIC_NAMES`` the names the model and optimizers had (for readers; a load does not need
them). So one directory format serves both front doors: a load gives the checkpoint's model to the module of the
dictionary and its optimizers to the optimizers, whatever their names, a Trainer's checkpoint as a Fabric's; the
other entries are restored by name as Fabric restores them; a Trainer resumes a Fabric checkpoint
from its weights and optimizer state (it finds no loops there: it starts counting steps from 0); a Fabric save adds
what a Trainer requires to resume (``_TRAINER_REQUIRES``: the Lightning version, the LR schedulers' states) when the
state lacks it, and a Fabric load takes it out again. Any world size, stage or bucket size loads any other, as for
the Trainer.

``ZeroConfig.state_dict_type="full"`` writes instead one file as Fabric's DDP (and FSDP's full state dict) does
(Note [one-file Fabric checkpoints]); ``exclude_frozen_parameters=True`` leaves the frozen parameters out and records
the pretrained source ``fabric.load_raw`` loaded, restored first by ``fabric.load`` (Note [frozen base restored from its
source] in ``checkpoint/frozen.py``). Both go through the Trainer's own functions.
"""

from __future__ import annotations

from collections.abc import Callable
from os import PathLike
from typing import TYPE_CHECKING, Any

import lightning
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.checkpoint.files import CheckpointError, load_lightning_state
from lightning_zero.checkpoint.frozen import FROZEN_KEY, frozen_keys, frozen_record, source_path
from lightning_zero.checkpoint.full_save import save_full_checkpoint
from lightning_zero.checkpoint.pretrained import is_pretrained_source
from lightning_zero.checkpoint.sharded_checkpoint import (
    load_checkpoint,
    load_full_checkpoint,
    load_pretrained,
    save_sharded_checkpoint,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.checkpoint.storage import locate
from lightning_zero.compat import FabricStateful, validate_keys_for_strict_loading
from lightning_zero.lightning.strategy_checkpoint import as_zero_optimizer

if TYPE_CHECKING:
    from lightning_zero.fabric.strategy import ZeroFabricStrategy

CheckpointPath = str | PathLike[str]
"""A checkpoint's location: a local path or an fsspec URL."""

FABRIC_NAMES = "fabric_names"
"""The names of the model and the optimizers in the Fabric state saved (Note [Fabric state in the Trainer's
format])."""
_FORMAT_KEYS = ("state_dict", "optimizer_states", FABRIC_NAMES, FROZEN_KEY)
_TRAINER_REQUIRES: dict[str, Any] = {"lr_schedulers": [], "pytorch-lightning_version": lightning.__version__}
"""What a Trainer's resume reads that a Fabric state need not have (Note [Fabric state in the Trainer's format])."""


def save_fabric_checkpoint(
    strategy: ZeroFabricStrategy,
    path: CheckpointPath,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]],
) -> None:
    """Write ``state`` as the sharded directory ``path`` (Note [Fabric state in the Trainer's format]), or with
    ``state_dict_type="full"`` as one file (Note [one-file Fabric checkpoints])."""
    module_name, optimizer_names = _named_objects(strategy, state, "save")
    config = strategy.config
    full = config.state_dict_type == "full"
    if config.exclude_frozen_parameters:
        refuse_unrestorable_frozen_base(strategy)
    if optimizer_names and any(name in filter for name in optimizer_names):
        raise ValueError(
            "`fabric.save(filter=...)` on an optimizer is not supported by ZeroFabricStrategy: its state is "
            "sharded with the model. HINT: filter the model's entries only."
        )
    checkpoint: dict[str, Any] = {}
    added = []
    for name, obj in state.items():
        if name in (module_name, *optimizer_names):
            continue
        if name in _FORMAT_KEYS:
            raise ValueError(
                f"`fabric.save` state key {name!r} is reserved by the sharded checkpoint format. HINT: rename it."
            )
        value = obj.state_dict() if isinstance(obj, FabricStateful) else obj
        checkpoint[name] = _filtered(value, filter.get(name))
    for key, value in _TRAINER_REQUIRES.items():  # a Trainer refuses a checkpoint without them
        if key not in checkpoint and not full:
            checkpoint[key] = value
            added.append(key)
    module = strategy._module
    if module_name is not None:
        assert module is not None
        model_state = sharded_model_state(
            module, strategy._optimizers, strategy._gatherer, strategy._tiers, config.exclude_frozen_parameters
        )
        keep = filter.get(module_name)
        if keep is not None:
            parameters = module.state_dict(keep_vars=True)
            model_state = {k: v for k, v in model_state.items() if keep(k, parameters[k])}
        checkpoint["state_dict"] = model_state
        if config.exclude_frozen_parameters:  # Note [frozen base restored from its source]
            checkpoint[FROZEN_KEY] = frozen_record(module, strategy.pretrained_source)
    if optimizer_names:
        checkpoint["optimizer_states"] = [
            sharded_optimizer_state(strategy._optimizers, i, strategy._tiers) for i in range(len(optimizer_names))
        ]
    if full:  # Note [one-file Fabric checkpoints]
        if module is None:
            raise ValueError(
                "ZeroConfig.state_dict_type='full' writes the set-up model's full state dict, and `fabric.save` got "
                "no model in `state`. HINT: `fabric.save(path, {'model': model, ...})`."
            )
        save_full_checkpoint(
            checkpoint,
            path,
            module,
            strategy._optimizers,
            strategy.process_group,
            strategy._gatherer,
            strategy._tiers,
            arrange=lambda full_state: _fabric_layout(full_state, module_name, optimizer_names),
        )
        return
    checkpoint[FABRIC_NAMES] = {"model": module_name, "optimizers": optimizer_names, "added": added}
    saved_with = {"world_size": strategy.world_size, "stage": config.stage}
    save_sharded_checkpoint(checkpoint, path, strategy.process_group, saved_with)


def _fabric_layout(checkpoint: dict[str, Any], module_name: str | None, optimizer_names: list[str]) -> dict[str, Any]:
    """A full checkpoint in Lightning's layout as Fabric's DDP saves ``state``: each object under its name."""
    arranged = {}
    if module_name is not None:
        arranged[module_name] = checkpoint.pop("state_dict")
    for name, optimizer_state in zip(optimizer_names, checkpoint.pop("optimizer_states", []), strict=True):
        arranged[name] = optimizer_state
    return {**arranged, **checkpoint}


def refuse_unrestorable_frozen_base(strategy: ZeroFabricStrategy) -> None:
    """``exclude_frozen_parameters=True`` on a model built on meta whose frozen base no ``fabric.load_raw`` loaded:
    no checkpoint of it could be resumed (Note [frozen base restored from its source]). Decided from state every rank
    shares."""
    module = strategy._module
    if module is None or not strategy.built_on_meta or strategy.pretrained_source is not None:
        return
    frozen = frozen_keys(module)
    if frozen:
        raise ValueError(
            f"ZeroConfig.exclude_frozen_parameters=True leaves {len(frozen)} frozen parameter(s) out of checkpoints "
            f"(e.g. {frozen[:3]}), but this model was built on the meta device (`fabric.init_module(empty_init=True)`)"
            " and initialized, and no pretrained weights were loaded: a resume could not restore them (Note [frozen "
            "base restored from its source]). HINT: load the pretrained base with `fabric.load_raw(<pretrained>, "
            "model)` after `fabric.setup`, build the model with its weights outside `init_module(empty_init=True)`, "
            "or set exclude_frozen_parameters=False."
        )


def load_fabric_checkpoint(
    strategy: ZeroFabricStrategy, path: CheckpointPath, state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """Restore the objects of ``state`` from the directory (or full ``.ckpt`` file) ``path``, in place; plain values
    are replaced in ``state``. Returns what of the checkpoint was not restored."""
    module_name, optimizer_names = _named_objects(strategy, state, "load")
    if module_name is None:
        raise ValueError(
            "ZeroFabricStrategy.load_checkpoint needs the set-up model in `state`: the model's shards and the rest "
            "of the checkpoint are read together. HINT: `fabric.load(path, {'model': model, ...})`."
        )
    assert strategy._module is not None
    built_on_meta = strategy.built_on_meta and strategy.pretrained_source is None  # nothing loaded into it yet
    single = _single_file_fabric_checkpoint(path, module_name)
    if single is not None:  # Note [one-file Fabric checkpoints]
        validate_keys_for_strict_loading(list(state), single.keys(), strict=strict)
        present = [name for name in optimizer_names if name in single]
        if present and len(present) != len(optimizer_names):
            raise CheckpointError(
                f"{path} holds the state of optimizers {present}, not of {optimizer_names}: ZeRO loads the optimizers "
                "of the model together. HINT: pass every optimizer the checkpoint holds, or none."
            )
        full_state = {"state_dict": single.pop(module_name), "optimizer_states": [single.pop(n) for n in present]}
        if FROZEN_KEY in single:
            full_state[FROZEN_KEY] = single.pop(FROZEN_KEY)
        load_full_checkpoint(
            full_state,
            locate(path),
            strategy._module,
            strategy._optimizers,
            load_optimizer=bool(present),
            strict=strict,
            gatherer=strategy._gatherer,
            tiers=strategy._tiers,
            built_on_meta=built_on_meta,
        )
        _note_frozen_source(strategy, full_state)
        return _restore_others(single, state, [module_name, *present], strict)
    loaded = load_checkpoint(
        path,
        strategy._module,
        strategy._optimizers,
        strategy.process_group,
        load_optimizer=bool(optimizer_names),
        strict=strict,
        gatherer=strategy._gatherer,
        tiers=strategy._tiers,
        built_on_meta=built_on_meta,
    )
    _note_frozen_source(strategy, loaded)
    names = loaded.pop(FABRIC_NAMES, None) or {}
    for key in (*_FORMAT_KEYS, *names.get("added", ())):
        loaded.pop(key, None)
    return _restore_others(loaded, state, [module_name, *optimizer_names], strict)


def _note_frozen_source(strategy: ZeroFabricStrategy, loaded: dict[str, Any]) -> None:
    """A checkpoint whose frozen base came from a pretrained source: so did this run's, and its saves say so."""
    frozen = loaded.get(FROZEN_KEY)
    if isinstance(frozen, dict) and frozen.get("source") is not None:
        strategy.pretrained_source = frozen["source"]


def _restore_others(loaded: dict[str, Any], state: dict[str, Any], restored: list[str], strict: bool) -> dict[str, Any]:
    """Fabric's semantics for the entries of ``state`` that are not the model or its optimizers: a stateful object
    loads its state, a plain value is replaced; what the checkpoint has beyond them is returned."""
    others = [k for k in state if k not in restored]
    validate_keys_for_strict_loading(others, loaded.keys(), strict=strict)
    for name in others:
        if name not in loaded:
            continue
        obj = state[name]
        if isinstance(obj, FabricStateful):
            obj.load_state_dict(loaded.pop(name))
        else:
            state[name] = loaded.pop(name)
    return loaded


def load_raw(strategy: ZeroFabricStrategy, path: CheckpointPath, module: Module, strict: bool) -> None:
    """``fabric.load_raw(path, model)``: a full state-dict file (``torch.save(model.state_dict())``, or a
    Lightning checkpoint, a ``.safetensors`` file or a Hugging Face directory) into the sharded model, streamed
    (``load_full_state_dict``); a sharded directory's weights too."""
    if module is not strategy._module:
        raise ValueError(
            f"`fabric.load_raw` got a {type(module).__name__} that ZeroFabricStrategy did not set up. HINT: set it up "
            "first (`fabric.setup(model)`), then load into it; ZeRO loads only into shards."
        )
    if _is_directory(path) and not is_pretrained_source(locate(path)):  # a sharded checkpoint, not a HF directory
        loaded = load_checkpoint(
            path,
            module,
            strategy._optimizers,
            strategy.process_group,
            load_optimizer=False,
            strict=strict,
            gatherer=strategy._gatherer,
            tiers=strategy._tiers,
            built_on_meta=strategy.built_on_meta and strategy.pretrained_source is None,
        )
        _note_frozen_source(strategy, loaded)
        return
    # A torch.save file, a .safetensors file or a Hugging Face directory: its keys under the prefix that names the
    # model's entries (found, e.g. none for the model itself), each rank reading only its ranges.
    load_pretrained(module, path, strategy._optimizers, strategy._gatherer, prefix=None, strict=strict,
                    tiers=strategy._tiers)  # fmt: skip
    # The frozen base came from here: checkpoints that leave it out record it (Note [frozen base restored from its
    # source]).
    strategy.pretrained_source = source_path(path)


def _named_objects(strategy: ZeroFabricStrategy, state: dict[str, Any], verb: str) -> tuple[str | None, list[str]]:
    """The name of the set-up model in ``state`` (or None), and those of its optimizers, all of them or none."""
    modules = [k for k, v in state.items() if isinstance(v, Module)]
    for name in modules:
        if state[name] is not strategy._module:
            raise ValueError(
                f"`fabric.{verb}` state {name!r} is a {type(state[name]).__name__} that ZeroFabricStrategy did not set "
                "up; a sharded checkpoint holds the one model set up. HINT: pass the model `fabric.setup` returned."
            )
    optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
    indices = [strategy._optimizers.index(as_zero_optimizer(state[k])) for k in optimizers]
    if optimizers and sorted(indices) != list(range(len(strategy._optimizers))):
        raise ValueError(
            f"`fabric.{verb}` state holds optimizers {optimizers}, not all {len(strategy._optimizers)} optimizers set "
            "up: their sharded states are saved and loaded together. HINT: pass every optimizer, or none."
        )
    ordered = [name for _, name in sorted(zip(indices, optimizers, strict=True))]
    return (modules[0] if modules else None), ordered


def _single_file_fabric_checkpoint(path: CheckpointPath, module_name: str) -> dict[str, Any] | None:
    """The contents of ``path`` if it is one file holding the model's state dict under ``module_name`` (not a
    Lightning checkpoint's ``state_dict``), memory-mapped; else None.

    Note [one-file Fabric checkpoints]
    Fabric's DDP (and single-device) strategies save ``fabric.save(path, state)`` as one ``torch.save`` file of the
    state with every object replaced by its state dict; so does ``ZeroConfig.state_dict_type="full"``, as Fabric's
    FSDP does with its full state dict: the model's full state dict under its name, each optimizer's full state under
    its name, in torch's format (state keyed by position in its param groups, as DDP's ``optimizer.state_dict()``,
    which is what DDP's ``fabric.load`` reads, rather than FSDP's keyed by parameter name), everything else as it is,
    streamed from the shards by rank 0 (Note [full checkpoint streamed] in ``checkpoint/full_save.py``, arranged by
    ``_fabric_layout``). Nothing of the sharded format is added: a DDP loop's ``fabric.load`` gets back only what was
    saved (and, with ``exclude_frozen_parameters``, the record of what was left out). ``fabric.load`` of such a file
    under ZeRO arranges it as a DDP Trainer's ``.ckpt`` (model under ``state_dict``, the optimizers the state names
    under ``optimizer_states`` in set-up order) and loads it as the Trainer does (``load_full_checkpoint``): each
    rank copies out its ranges of the weights and, through the optimizers' param groups, which name the parameter at
    each position, of the optimizer state; the rest is restored as Fabric restores it. A one-file Lightning
    checkpoint (a DDP Trainer's) has the ``state_dict`` layout and goes through ``load_checkpoint``.
    """
    location = locate(path)
    if not location.isfile():
        return None
    contents = load_lightning_state(location, mmap=True)
    if "state_dict" in contents or not isinstance(contents.get(module_name), dict):
        return None
    return contents


def _filtered(value: Any, keep: Callable[[str, Any], bool] | None) -> Any:
    if keep is None or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if keep(k, v)}


def _is_directory(path: CheckpointPath) -> bool:
    location = locate(path)
    return location.exists() and not location.isfile()
