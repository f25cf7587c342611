"""Fabric's ``save``/``load`` in the Trainer's sharded checkpoint format (``lightning_zero.checkpoint``): where each
object goes and what each load takes is ``checkpoint_layout.py``'s (Note [Fabric state in the Trainer's format]); this
file writes and reads it (``load_raw``, one object from a raw file, is ``raw_loads.py``'s).

``ZeroConfig.state_dict_type="full"`` writes instead one file as Fabric's DDP (and FSDP's full state dict) does
(Note [one-file Fabric checkpoints]); ``exclude_frozen_parameters=True`` leaves the frozen parameters out and records
the pretrained source ``fabric.load_raw`` loaded, restored first by ``fabric.load`` (Note [frozen base restored from its
source] in ``checkpoint/frozen.py``). Both go through the Trainer's own functions.

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

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torch.nn import Module

from lightning_zero.checkpoint.files import CheckpointError, load_lightning_state
from lightning_zero.checkpoint.frozen import FROZEN_KEY, frozen_keys, frozen_record
from lightning_zero.checkpoint.full_save import save_full_checkpoint
from lightning_zero.checkpoint.pretrained import is_pretrained_source
from lightning_zero.checkpoint.sections import prefixed, prefixed_optimizer_state, read_checkpoint_state
from lightning_zero.checkpoint.sharded_checkpoint import (
    load_checkpoint,
    load_full_checkpoint,
    save_sharded_checkpoint,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.checkpoint.storage import Location, locate
from lightning_zero.compat import validate_keys_for_strict_loading
from lightning_zero.config import ZeroConfig
from lightning_zero.fabric.async_saves import FabricSaves
from lightning_zero.fabric.checkpoint_layout import (
    FABRIC_NAMES,
    FORMAT_KEYS,
    TRAINER_REQUIRES,
    SaveLayout,
    restore_others,
    restore_plan,
    save_layout,
    saved_contents,
)
from lightning_zero.fabric.module import refuse_released_parameters
from lightning_zero.fabric.optimizer_steps import STEPS_KEY, TRAINER_STEPS_KEY, OptimizerSteps
from lightning_zero.fabric.raw_loads import (
    CheckpointPath,
    LoadingStrategy,
    load_pretrained_weights,
    note_frozen_source,
    unloaded_meta,
)


class CheckpointingStrategy(LoadingStrategy, Protocol):
    """What these functions use of ``ZeroFabricStrategy`` (``strategy.py``, which calls them)."""

    @property
    def config(self) -> ZeroConfig: ...
    @property
    def optimizer_steps(self) -> OptimizerSteps: ...
    @property
    def saves(self) -> FabricSaves: ...
    @property
    def _module(self) -> Module | None: ...
    @property
    def built_on_meta(self) -> bool: ...
    @property
    def world_size(self) -> int: ...


# -- save ------------------------------------------------------------------------------------------------------------
def save_fabric_checkpoint(
    strategy: CheckpointingStrategy,
    path: CheckpointPath,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]],
) -> None:
    """Write ``state`` as the sharded directory ``path`` (Note [Fabric state in the Trainer's format]), or with
    ``state_dict_type="full"`` as one file (Note [one-file Fabric checkpoints]). Every refusal comes before anything
    is written."""
    layout = save_layout(strategy.models, state, filter)
    config = strategy.config
    full = config.state_dict_type == "full"
    if config.exclude_frozen_parameters:
        refuse_unrestorable_frozen_base(strategy)
    for model in strategy.models:
        if model.gatherer is not None:
            refuse_released_parameters(layout.plain, model.module)
    if full and len(layout.sections) > 1:
        names = [name.rstrip(".") for name, _ in layout.sections]
        raise ValueError(
            f"ZeroConfig.state_dict_type='full' writes one set-up model and its optimizers per file, as Fabric's FSDP "
            f"does, and `fabric.save` got the parts of {len(names)}: {names}. HINT: save each model (with its "
            "optimizers) to a file of its own, or use state_dict_type='sharded', which holds them all in one "
            "checkpoint (`python -m lightning_zero consolidate` makes one file of it)."
        )
    checkpoint = dict(layout.plain)
    added = [key for key in TRAINER_REQUIRES if key not in checkpoint and not full]
    checkpoint.update({key: TRAINER_REQUIRES[key] for key in added})  # a Trainer refuses a checkpoint without them
    tiers = strategy._tiers
    if layout.models:
        checkpoint["state_dict"] = {}
        for name, model in layout.models.items():
            model_state = sharded_model_state(
                model.module, model.optimizers, model.gatherer, tiers, config.exclude_frozen_parameters
            )
            keep = filter.get(name)
            if keep is not None:
                parameters = model.module.state_dict(keep_vars=True)
                model_state = {k: v for k, v in model_state.items() if keep(k, parameters[k])}
            checkpoint["state_dict"].update(prefixed(model_state, layout.prefix(model)))
            if config.exclude_frozen_parameters:  # one set-up model (setup_module refuses a second)
                checkpoint[FROZEN_KEY] = frozen_record(model.module, strategy.pretrained_source)
    if full:
        _save_one_file(strategy, path, checkpoint, layout)
        return
    if layout.optimizers:
        checkpoint["optimizer_states"] = [
            prefixed_optimizer_state(
                sharded_optimizer_state(o.model.optimizers, o.model.optimizers.index(o.optimizer), tiers),
                layout.prefix(o.model),
            )
            for o in layout.optimizers
        ]
    checkpoint[FABRIC_NAMES] = layout.record(added)
    checkpoint[STEPS_KEY] = _saved_steps(strategy, layout)  # Note [delayed update in a Fabric loop]
    saved_with = {"world_size": strategy.world_size, "stage": config.stage}
    if strategy.saves.saver is not None:  # Note [asynchronous saves in a Fabric loop]
        strategy.saves.saver.save(checkpoint, path, strategy.process_group, saved_with)
        return
    save_sharded_checkpoint(checkpoint, path, strategy.process_group, saved_with)


def _saved_steps(strategy: CheckpointingStrategy, layout: SaveLayout) -> dict[str, int]:
    return strategy.optimizer_steps.saved((o.name, o.optimizer) for o in layout.optimizers)


def _save_one_file(
    strategy: CheckpointingStrategy, path: CheckpointPath, checkpoint: dict[str, Any], layout: SaveLayout
) -> None:
    """The one model of ``layout`` (or none) and its optimizers saved, as one file (Note [one-file Fabric
    checkpoints])."""
    model = layout.sections[0][1] if layout.sections else None
    module_name = next(iter(layout.models), None)
    names = {id(o.optimizer): o.name for o in layout.optimizers}
    optimizers = model.optimizers if model is not None else []
    optimizer_names = [names.get(id(zero)) for zero in optimizers]
    if names and strategy.config.offload_overlap == "delayed":  # Note [delayed update in a Fabric loop]
        checkpoint[STEPS_KEY] = _saved_steps(strategy, layout)
    if names:
        checkpoint["optimizer_states"] = [
            sharded_optimizer_state(optimizers, i, strategy._tiers) if name is not None else None
            for i, name in enumerate(optimizer_names)
        ]
    save_full_checkpoint(
        checkpoint,
        path,
        model.module if model is not None else Module(),
        optimizers,
        strategy.process_group,
        model.gatherer if model is not None else None,
        strategy._tiers,
        arrange=lambda full_state: _fabric_layout(full_state, module_name, optimizer_names),
    )


def _fabric_layout(
    checkpoint: dict[str, Any], module_name: str | None, optimizer_names: list[str | None]
) -> dict[str, Any]:
    """A full checkpoint in Lightning's layout as Fabric's DDP saves ``state``: each object under its name."""
    arranged = {}
    if module_name is not None:
        arranged[module_name] = checkpoint.pop("state_dict")
    states = checkpoint.pop("optimizer_states", None) or [None] * len(optimizer_names)
    for name, optimizer_state in zip(optimizer_names, states, strict=True):
        if name is not None:
            arranged[name] = optimizer_state
    return {**arranged, **checkpoint}


def refuse_unrestorable_frozen_base(strategy: CheckpointingStrategy) -> None:
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


# -- load ------------------------------------------------------------------------------------------------------------
def load_fabric_checkpoint(
    strategy: CheckpointingStrategy, path: CheckpointPath, state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """Restore the objects of ``state`` from the directory (or one file) ``path``, in place; plain values are
    replaced in ``state``. Returns what of the checkpoint was not restored: all of it but the models' and
    optimizers' shards when ``state`` is empty (a sharded checkpoint's model and optimizer states are read only into
    set-up objects)."""
    location = locate(path)
    if location.isfile():
        contents = load_lightning_state(location, mmap=True)
        if "state_dict" not in contents:  # Note [one-file Fabric checkpoints]
            return _load_one_file(strategy, location, contents, state, strict)
        # A Lightning checkpoint in one file (a DDP Trainer's): its model and optimizers by position.
        optimizer_states = contents.get("optimizer_states") or []
        others = {k: v for k, v in contents.items() if k not in FORMAT_KEYS}
        saved = saved_contents(None, contents["state_dict"].keys(), len(optimizer_states), others.keys())
        counts, trainer_step = None, contents.get(TRAINER_STEPS_KEY)
    elif is_pretrained_source(location):  # weights only, as for the Trainer's `fit(ckpt_path=hf_dir)`
        return load_pretrained_weights(strategy, path, state, strict)
    else:
        lightning_state, toc = read_checkpoint_state(path, strategy.process_group)
        record = lightning_state.get(FABRIC_NAMES)
        drop = {*FORMAT_KEYS, *(record.get("added", ()) if isinstance(record, dict) else ())}
        others = {k: v for k, v in lightning_state.items() if k not in drop}
        saved = saved_contents(record, toc["state_dict"].keys(), len(toc["optimizers"]), others.keys())
        counts = lightning_state.get(STEPS_KEY)
        trainer_step = lightning_state.get(TRAINER_STEPS_KEY) if not isinstance(record, dict) else None
    if not state:
        return others
    plan = restore_plan(strategy.models, state, saved, strict)
    for model, section in plan.sections:
        loaded = load_checkpoint(
            path,
            model.module,
            model.optimizers,
            strategy.process_group,
            load_optimizer=False,  # the section says which
            strict=strict,
            gatherer=model.gatherer,
            tiers=strategy._tiers,
            built_on_meta=unloaded_meta(strategy, model),
            section=section,
        )
        note_frozen_source(strategy, loaded)
        chosen = zip(model.optimizers, section.optimizers, strict=True)  # Note [delayed update in a Fabric loop]
        loaded_optimizers = [(o, saved.optimizers[i]) for o, i in chosen if i is not None]
        strategy.optimizer_steps.restore(loaded_optimizers, counts, trainer_step)
    for name, section in plan.plain.items():  # no shards: every rank reads the weights whole
        load_checkpoint(path, state[name], [], strategy.process_group, load_optimizer=False, strict=strict,
                        section=section)  # fmt: skip
    return restore_others(others, state, plan.restored, strict)


def _load_one_file(
    strategy: CheckpointingStrategy, origin: Location, contents: dict[str, Any], state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """Note [one-file Fabric checkpoints]: each set-up model and optimizer of ``state`` from the entry of its name."""
    counts = contents.pop(STEPS_KEY, None)  # Note [delayed update in a Fabric loop]
    if not state:
        return contents
    validate_keys_for_strict_loading(list(state), contents.keys(), strict=strict)
    restored: list[str] = []
    for model in strategy.models:
        module_name = next((n for n, o in state.items() if strategy.models.of(o) is model and n in contents), None)
        optimizer_names = [
            next((n for n, o in state.items() if strategy.models.optimizer(o) is zero), None)
            for zero in model.optimizers
        ]
        optimizer_names = [n if n in contents else None for n in optimizer_names]
        if module_name is None and not any(optimizer_names):
            continue
        if module_name is not None and not isinstance(contents[module_name], Mapping):
            raise CheckpointError(
                f"{origin} holds a {type(contents[module_name]).__name__} under {module_name!r}, not a state dict. "
                "HINT: load the entry of that name into a plain value, or save the model under it."
            )
        full_state: dict[str, Any] = {
            "state_dict": contents.pop(module_name) if module_name is not None else {},
            "optimizer_states": [contents.pop(n) if n is not None else None for n in optimizer_names],
        }
        if FROZEN_KEY in contents and module_name is not None:
            full_state[FROZEN_KEY] = contents.pop(FROZEN_KEY)
        load_full_checkpoint(
            full_state,
            origin,
            model.module,
            model.optimizers,
            load_optimizer=any(n is not None for n in optimizer_names),
            strict=strict and module_name is not None,
            gatherer=model.gatherer,
            tiers=strategy._tiers,
            built_on_meta=unloaded_meta(strategy, model),
        )
        note_frozen_source(strategy, full_state)
        loaded = [(zero, name) for zero, name in zip(model.optimizers, optimizer_names, strict=True) if name]
        strategy.optimizer_steps.restore(loaded, counts)
        restored += [n for n in (module_name, *optimizer_names) if n is not None]
    return restore_others(contents, state, restored, strict)
