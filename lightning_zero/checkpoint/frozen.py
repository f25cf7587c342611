"""Adapter-sized checkpoints (``ZeroConfig.exclude_frozen_parameters``, DeepSpeed's option of that name): frozen
parameters are left out of the checkpoint and come back, on resume, from where the run got them.

Note [frozen base restored from its source]
Fine-tuning with adapters (peft LoRA) trains a few parameters on top of a frozen base that may be most of the model.
A checkpoint then holds the trainable parameters, their optimizer state and the buffers, and records in Lightning's
state (``FROZEN_KEY``) which entries it left out and the pretrained source the run loaded its weights from: a file or
directory loaded by ``fit(ckpt_path=...)`` or ``load_full_state_dict(trainer.strategy, ...)``, or none when the
model held its weights as it was built (``from_pretrained`` in ``__init__``). A resume loads the recorded source
first (its keys matched as when it was first loaded) and the checkpoint over it, so the frozen base comes from the
same place as in the run that saved. It refuses, before training, when the source is recorded but gone, and when
none is recorded but this run built the model on the meta device and only initialized it (``configure_model`` at
stage 3): the frozen base would be freshly initialized weights. ``consolidate`` writes what the checkpoint holds: the
adapters alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.storage import Location, locate
from lightning_zero.sharding.activation_checkpointing import state_dict_name

FROZEN_KEY = "lightning_zero_frozen"
"""Key in a checkpoint's Lightning state: ``{"excluded": [state-dict keys], "source": path or None}``."""


def frozen_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of ``module``'s frozen parameters (``requires_grad=False``), tied names included."""
    return [
        k for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter) and not v.requires_grad
    ]


def source_path(source: object) -> str | None:
    """A pretrained source as a checkpoint records it: an absolute local path, a URL, or None (not a path)."""
    if not isinstance(source, str | os.PathLike):
        return None
    location = locate(source)
    return location.url if location.remote else os.path.abspath(location.local)


def frozen_record(module: nn.Module, source: str | None) -> dict[str, Any]:
    """What a checkpoint that leaves the frozen parameters out records about them (``FROZEN_KEY``)."""
    return {"excluded": frozen_keys(module), "source": source}


def frozen_source(record: object, origin: Location, *, built_on_meta: bool) -> tuple[list[str], str | None]:
    """The keys a checkpoint left out and the source to restore them from, or a clear refusal (Note [frozen base
    restored from its source])."""
    if not isinstance(record, dict) or not isinstance(record.get("excluded"), list):
        raise CheckpointError(f"{origin} has an invalid {FROZEN_KEY!r} entry. HINT: the file was modified.")
    excluded, source = record["excluded"], record.get("source")
    if not excluded:
        return [], None
    if source is not None and not locate(source).exists():
        raise CheckpointError(
            f"{origin} leaves out the frozen parameters (ZeroConfig.exclude_frozen_parameters=True) and restores "
            f"them from the pretrained weights the run loaded, {source}, which no longer exists. HINT: put the "
            "pretrained weights back at that path, or resume from a checkpoint saved with "
            "exclude_frozen_parameters=False."
        )
    if source is None and built_on_meta:
        raise CheckpointError(
            f"{origin} leaves out {len(excluded)} frozen parameter(s) (ZeroConfig.exclude_frozen_parameters=True), "
            f"e.g. {excluded[:3]}, and records no pretrained source: the run that saved held them as its model was "
            "built. This run built the model on the meta device and initialized it, so the frozen base would be "
            "freshly initialized weights. HINT: build the model with its pretrained weights in `__init__` (e.g. "
            "`from_pretrained`), or load them with `trainer.fit(model, ckpt_path=<pretrained>)` or "
            "`lightning_zero.load_full_state_dict(trainer.strategy, <pretrained>)` in the run that saves, so that "
            "its checkpoints record where to restore them from."
        )
    return list(excluded), source


def adapter_prefixes(module: nn.Module) -> Sequence[str]:
    """State-dict key prefixes of the adapters peft injected (``...q_proj.lora_A.``): a pretrained file of the base
    model does not hold them, and they keep their initialization. Named as ``state_dict()`` keys them, without
    checkpoint wrappers' segments (Note [checkpoint wrappers keep the names] in
    ``sharding/activation_checkpointing.py``)."""
    prefixes = []
    for wrapped_name, child in module.named_modules():
        name = state_dict_name(wrapped_name)
        for adapter in getattr(child, "adapter_layer_names", ()):  # peft's BaseTunerLayer
            prefixes.append(f"{name}.{adapter}." if name else f"{adapter}.")
    return prefixes
