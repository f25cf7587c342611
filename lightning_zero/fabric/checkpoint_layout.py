"""Where each object of a Fabric state goes in a checkpoint, and what each object of a load takes from one.

Note [Fabric state in the Trainer's format]
A Fabric checkpoint is a dictionary of named objects (``{"model": model, "optimizer": optimizer, "step": 3}``);
the Trainer's holds its model under ``state_dict`` and its optimizers, in order, under ``optimizer_states``. A Fabric
save writes the set-up models in the state as ``state_dict``, each in its section (Note [several models in one
checkpoint] in ``checkpoint/sections.py``: with one model, the model's own keys; with several, each under its name),
the set-up optimizers in the state as ``optimizer_states`` in the order they were set up, and everything else as
Fabric's DDP saves it: a module that was not set up (a frozen teacher) or any other stateful object as its
``state_dict()``, a plain value as it is. Under ``FABRIC_NAMES`` it records the name and section of each model and
optimizer. So one directory format serves both front doors: a Trainer whose LightningModule holds the models as
children under their names (or is the one model) resumes a Fabric checkpoint from its weights and optimizer state
(it finds no loops there: it starts counting steps from 0), and a Trainer's checkpoint loads into a Fabric loop: into
one model whole, or into several, each from the children under its name, the optimizers by position.

A load restores any part of what was saved, as Fabric's DDP does: each set-up model and optimizer of the state takes
the saved one of its name (the one model and its optimizers whatever their names, when the checkpoint holds one
model and the state asks for one), a module that was not set up takes the weights of the set-up model saved under
its name whole, on every rank (as a DDP checkpoint saved after ``setup`` loads into a plain module), every other
entry is restored by name (a stateful object loads its state, a plain value is replaced), and what the checkpoint
holds beyond the state is returned. With ``strict=True`` a name the
checkpoint does not hold is refused before anything is loaded. A save adds what a Trainer requires to resume
(``TRAINER_REQUIRES``: the Lightning version, the LR schedulers' states) when the state lacks it, and a load takes it
out again. Any world size, stage or bucket size loads any other, as for the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import lightning
from torch.nn import Module

from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.frozen import FROZEN_KEY
from lightning_zero.checkpoint.sections import Section
from lightning_zero.compat import FabricStateful, validate_keys_for_strict_loading
from lightning_zero.fabric.models import SetUpModel, SetUpModels
from lightning_zero.fabric.optimizer_steps import STEPS_KEY
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer

FABRIC_NAMES = "fabric_names"
"""The names and sections of the models and optimizers in the Fabric state saved (Note [Fabric state in the
Trainer's format])."""
FORMAT_KEYS = ("state_dict", "optimizer_states", FABRIC_NAMES, FROZEN_KEY, STEPS_KEY)
TRAINER_REQUIRES: dict[str, Any] = {"lr_schedulers": [], "pytorch-lightning_version": lightning.__version__}
"""What a Trainer's resume reads that a Fabric state need not have (Note [Fabric state in the Trainer's format])."""


class SavedOptimizer(NamedTuple):
    name: str
    optimizer: ZeroOptimizer
    model: SetUpModel


class SaveLayout(NamedTuple):
    """What a save writes where, decided before anything is written."""

    models: dict[str, SetUpModel]
    """The set-up models of the state, by name."""
    optimizers: list[SavedOptimizer]
    """The set-up optimizers of the state, in the order they were set up."""
    sections: list[tuple[str, SetUpModel]]
    """(prefix, model) for every model saved or whose optimizers are (Note [several models in one checkpoint])."""
    plain: dict[str, Any]
    """Every other entry as it is written: the state dict of a stateful object, filtered; a plain value."""

    def prefix(self, model: SetUpModel) -> str:
        return next(p for p, m in self.sections if m is model)

    def record(self, added: list[str]) -> dict[str, Any]:
        """``FABRIC_NAMES``: the names and sections, and which entries the save added for a Trainer."""
        return {
            "models": {name: self.prefix(model) for name, model in self.models.items()},
            "optimizers": [o.name for o in self.optimizers],
            "sections": [self.prefix(o.model) for o in self.optimizers],
            "added": added,
        }


def save_layout(
    models: SetUpModels, state: dict[str, Any], filter: dict[str, Callable[[str, Any], bool]]
) -> SaveLayout:
    """Where each entry of ``state`` goes; refuses what cannot be saved, before anything is written."""
    set_up: dict[str, SetUpModel] = {}
    optimizers: list[SavedOptimizer] = []
    plain: dict[str, Any] = {}
    for name, obj in state.items():
        if name in FORMAT_KEYS:
            raise ValueError(
                f"`fabric.save` state key {name!r} is reserved by the sharded checkpoint format. HINT: rename it."
            )
        model = models.of(obj)
        zero = models.optimizer(obj)
        if model is not None:
            set_up[name] = model
        elif zero is not None:
            if name in filter:
                raise ValueError(
                    f"`fabric.save(filter={{{name!r}: ...}})` on an optimizer is not supported by ZeroFabricStrategy: "
                    "its state is sharded with the model. HINT: filter the model's entries only."
                )
            optimizers.append(SavedOptimizer(name, zero, models.model_of(zero)))
        else:
            value = obj.state_dict() if isinstance(obj, FabricStateful) else obj
            plain[name] = _filtered(value, filter.get(name))
    optimizers.sort(key=lambda o: next(i for i, z in enumerate(models.optimizers) if z is o.optimizer))
    # A model's section is named after it, or after its first optimizer saved when the model itself is not.
    named = [*((name, m) for name, m in set_up.items()), *((o.name, o.model) for o in optimizers)]
    first: dict[int, tuple[str, SetUpModel]] = {}
    for name, model in named:
        first.setdefault(id(model), (name, model))
    alone = len(first) == 1
    sections = [("" if alone else f"{name}.", model) for name, model in first.values()]
    return SaveLayout(set_up, optimizers, sections, plain)


def _filtered(value: Any, keep: Callable[[str, Any], bool] | None) -> Any:
    if keep is None or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if keep(k, v)}


# -- load ------------------------------------------------------------------------------------------------------------
class Saved(NamedTuple):
    """What a checkpoint holds, as a load matches the state against it."""

    models: dict[str, str] | None
    """Fabric's: each saved model's name -> its section's prefix; None for a Trainer's checkpoint (its one
    LightningModule, whose children may be the models)."""
    optimizers: list[str | None]
    """Each saved optimizer's name (None: a Trainer's, known by position)."""
    sections: list[str]
    """Each saved optimizer's section prefix (a Trainer's: decided by the load)."""
    model_keys: Collection[str]
    """The saved model entries' keys."""
    others: Collection[str]
    """The names of the other entries."""


def saved_contents(record: Any, model_keys: Collection[str], optimizer_count: int, others: Collection[str]) -> Saved:
    """A checkpoint's contents from its ``FABRIC_NAMES`` record (None: a Trainer's checkpoint)."""
    if not isinstance(record, dict):
        return Saved(None, [None] * optimizer_count, [""] * optimizer_count, model_keys, others)
    names = list(record.get("optimizers", []))
    if "models" in record:
        models, sections = dict(record["models"]), list(record["sections"])
    else:  # written when a Fabric checkpoint held one model
        models, sections = ({record["model"]: ""} if record.get("model") else {}), [""] * len(names)
    if len(names) != optimizer_count or len(sections) != optimizer_count:
        raise CheckpointError(
            f"The checkpoint records {len(names)} optimizer name(s) for {optimizer_count} optimizer state(s). HINT: "
            "the file was modified; use another checkpoint."
        )
    return Saved(models, names, sections, model_keys, others)


class RestorePlan(NamedTuple):
    """What each set-up model loads, and which entries of the state that restores."""

    sections: list[tuple[SetUpModel, Section]]
    restored: list[str]
    plain: dict[str, Section]
    """By name in the state: a module that was not set up, loading the full weights of a model saved set up."""


def restore_plan(models: SetUpModels, state: dict[str, Any], saved: Saved, strict: bool) -> RestorePlan:
    """Match the set-up models and optimizers of ``state`` with what ``saved`` holds (Note [Fabric state in the
    Trainer's format]); with ``strict``, refuse a name of ``state`` the checkpoint does not hold, before loading."""
    set_up = {name: m for name, m in ((n, models.of(o)) for n, o in state.items()) if m is not None}
    zeros = {name: z for name, z in ((n, models.optimizer(o)) for n, o in state.items()) if z is not None}
    order = sorted(zeros, key=lambda n: next(i for i, z in enumerate(models.optimizers) if z is zeros[n]))
    involved = list({id(m): m for m in [*set_up.values(), *(models.model_of(zeros[n]) for n in order)]}.values())
    model_from: dict[str, str] = {}  # name in state -> section prefix
    optimizer_from: dict[str, int] = {}  # name in state -> saved optimizer
    if saved.models is not None:
        model_from = {name: saved.models[name] for name in set_up if name in saved.models}
        if not model_from and len(set_up) == 1 and len(saved.models) == 1:  # the one model, whatever its name
            model_from = {next(iter(set_up)): next(iter(saved.models.values()))}
        optimizer_from = {name: saved.optimizers.index(name) for name in order if name in saved.optimizers}
        one_section = len(set(saved.sections)) == 1 and len(involved) == 1
        if not optimizer_from and order and one_section and len(order) == len(saved.optimizers):
            optimizer_from = dict(zip(order, range(len(order)), strict=True))  # its optimizers, whatever their names
    else:  # a Trainer's checkpoint: one model whole, or several from the children under their names

        def prefix_of(model: SetUpModel) -> str | None:
            if len(involved) == 1:
                return ""
            name = next((n for n, m in set_up.items() if m is model), None)
            return None if name is None else f"{name}."

        model_from = {
            name: prefix
            for name, model in set_up.items()
            if (prefix := prefix_of(model)) is not None and any(k.startswith(prefix) for k in saved.model_keys)
        }
        if order and len(order) != len(saved.optimizers):
            raise CheckpointError(
                f"The checkpoint is a Trainer's, whose {len(saved.optimizers)} optimizer(s) are matched by position,"
                f" and `state` holds {len(order)}. HINT: pass every optimizer, in the order they were set up."
            )
        optimizer_from = dict(zip(order, range(len(order)), strict=True))
        saved = saved._replace(sections=[_trainer_section(prefix_of, models, zeros[n]) for n in order])
    for name in order:
        if name not in optimizer_from and name in saved.others:
            raise CheckpointError(
                f"The checkpoint holds {name!r} as the state dict of an optimizer ZeRO did not set up, and "
                f"`state[{name!r}]` is a set-up optimizer, whose state is sharded. HINT: load it into an optimizer "
                "that was not set up, or save the set-up optimizer."
            )
    # A model saved set up, asked for by a module that is not (a plain copy, as Fabric's DDP loads one): its weights
    # whole on every rank.
    plain = {
        name: Section(saved.models[name], True, ())
        for name, obj in state.items()
        if saved.models is not None and name in saved.models and name not in set_up and isinstance(obj, Module)
    }
    available = [*saved.others, *model_from, *optimizer_from, *plain]
    validate_keys_for_strict_loading(list(state), available, strict=strict)
    parts: dict[tuple[int, str], tuple[SetUpModel, bool, dict[int, int]]] = {}
    for name, prefix in model_from.items():
        model = set_up[name]
        parts[(id(model), prefix)] = (model, True, {})
    for name, index in optimizer_from.items():
        model = models.model_of(zeros[name])
        prefix = saved.sections[index]
        entry = parts.setdefault((id(model), prefix), (model, False, {}))
        entry[2][next(i for i, o in enumerate(model.optimizers) if o is zeros[name])] = index
    sections = [
        (model, Section(prefix, load_model, tuple(chosen.get(i) for i in range(len(model.optimizers)))))
        for (_, prefix), (model, load_model, chosen) in parts.items()
    ]
    return RestorePlan(sections, [*model_from, *optimizer_from, *plain], plain)


def _trainer_section(prefix_of: Callable[[SetUpModel], str | None], models: SetUpModels, zero: ZeroOptimizer) -> str:
    prefix = prefix_of(models.model_of(zero))
    if prefix is None:
        raise CheckpointError(
            "A Trainer's checkpoint holds its models as children of one LightningModule: an optimizer of a model "
            "that `state` does not name cannot be matched to them. HINT: pass the model too, under the name the "
            "LightningModule gave it."
        )
    return prefix


def restore_others(
    loaded: dict[str, Any], state: dict[str, Any], restored: Collection[str], strict: bool
) -> dict[str, Any]:
    """Fabric's semantics for the entries of ``state`` not restored as set-up objects: a module loads its state dict
    (``strict``), another stateful object its state, a plain value is replaced; what the checkpoint has beyond them
    is returned."""
    for name in state:
        if name in restored or name not in loaded:
            continue
        obj = state[name]
        if isinstance(obj, Module):  # a set-up model too: a plain state dict loads into it as into the model
            obj.load_state_dict(loaded.pop(name), strict=strict)
        elif isinstance(obj, FabricStateful):
            obj.load_state_dict(loaded.pop(name))
        else:
            state[name] = loaded.pop(name)
    return loaded
