"""Several models in one checkpoint: each model's entries under a prefix of its own, loaded one model at a time.

Note [several models in one checkpoint]
A Trainer's checkpoint holds one model, the LightningModule, whose children a GAN or a distillation names
(``generator.``, ``discriminator.``), and its optimizers in one list. A front door that sets up several models
(Fabric: a generator and a discriminator, a student and a teacher) writes them in the same layout: each model's
*section* is its state-dict keys, the parameter names of its optimizers' state and of its fp32 masters, all under a
prefix (the model's name and a dot), and the optimizers of every model are one list. So the checkpoint is the one a
LightningModule holding the models as children under those names writes, and it loads into one, and the reverse. With
one model the prefix is empty: the layout is exactly the Trainer's.

A model is loaded from its section through a view of the table of contents (``section_toc``) whose keys are the
model's own, and which lists, for each of the model's optimizers, the checkpoint optimizer it takes (or none: a
``Section`` may load the model alone, some of its optimizers alone, or both). The storage keys stay the checkpoint's,
so the load plan reads exactly what the save wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.format import Toc, open_committed
from lightning_zero.checkpoint.frozen import FROZEN_KEY
from lightning_zero.checkpoint.local_commit import recover_interrupted_commit
from lightning_zero.checkpoint.storage import locate

V = TypeVar("V")


class Section(NamedTuple):
    """What one model loads of a checkpoint (Note [several models in one checkpoint])."""

    prefix: str
    """Its keys in the checkpoint: ``"<name>."``, or ``""`` for the checkpoint's only model."""
    model: bool
    """Whether its weights and buffers are loaded."""
    optimizers: tuple[int | None, ...]
    """For each of the model's optimizers, in its order: the checkpoint optimizer it loads, or None."""


def prefixed(state: Mapping[str, V], prefix: str) -> dict[str, V]:
    """``state`` with every key under ``prefix``."""
    return {prefix + key: value for key, value in state.items()}


def prefixed_optimizer_state(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A ``sharded_optimizer_state`` with its parameter names under ``prefix``."""
    return {**state, "state": prefixed(state["state"], prefix), "masters": prefixed(state["masters"], prefix)}


def _under(entries: Mapping[str, V], prefix: str) -> dict[str, V]:
    return {key[len(prefix) :]: value for key, value in entries.items() if key.startswith(prefix)}


def section_toc(toc: Toc, section: Section) -> Toc:
    """The table of contents as the section's model sees it: its own keys, its optimizers' entries in its order."""
    optimizers = toc["optimizers"]
    for index in section.optimizers:
        if index is not None and not 0 <= index < len(optimizers):
            raise CheckpointError(
                f"The checkpoint holds {len(optimizers)} optimizer(s); optimizer {index} was asked for. HINT: the "
                "checkpoint's record of its optimizers was modified; use another checkpoint."
            )
    return {
        **toc,
        "state_dict": _under(toc["state_dict"], section.prefix) if section.model else {},
        "optimizers": [{} if i is None else _under(optimizers[i], section.prefix) for i in section.optimizers],
    }


def section_state(state: dict[str, Any], section: Section) -> None:
    """Lightning's state of the checkpoint as the section's model loads it, in place: the model's entries of a full
    ``state_dict`` (a one-file checkpoint), its optimizers' states in its order (None: not loaded), and the frozen
    entries a checkpoint left out, by the model's own keys."""
    if isinstance(state.get("state_dict"), Mapping):
        state["state_dict"] = _under(state["state_dict"], section.prefix) if section.model else {}
    saved = state.get("optimizer_states") or []
    state["optimizer_states"] = [None if i is None else saved[i] for i in section.optimizers]
    frozen = state.get(FROZEN_KEY)
    if isinstance(frozen, dict) and isinstance(frozen.get("excluded"), list):
        excluded = [k[len(section.prefix) :] for k in frozen["excluded"] if k.startswith(section.prefix)]
        state[FROZEN_KEY] = {**frozen, "excluded": excluded if section.model else []}


def read_checkpoint_state(
    path: str | PathLike[str], process_group: dist.ProcessGroup | None
) -> tuple[dict[str, Any], Toc]:
    """A committed checkpoint directory's Lightning state and table of contents, on every rank (collective): what a
    load that picks its parts reads first."""
    checkpoint = locate(path)
    if not checkpoint.remote and (process_group is None or process_group.rank() == 0):
        recover_interrupted_commit(checkpoint.local)  # Note [atomic commit]
    if process_group is not None:
        dist.barrier(group=process_group)
    checkpoint.forget_listings()
    state, toc, _, _ = open_committed(checkpoint)
    return state, toc
