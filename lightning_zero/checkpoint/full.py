"""Full (unsharded) state as a source for ZeRO's load plan: a DDP run's ``.ckpt`` file, or pretrained weights.

Both become what a sharded checkpoint provides: a table of contents (``checkpoint.format``) and, per storage key, a
source tensor: here the full tensor itself, flattened without a copy (memory-mapped when it comes from a file, so a
rank pages in only the ranges it copies out, one parameter at a time). A torch optimizer's state is keyed by position
in its param groups; positions become parameter names through ``ZeroOptimizer.param_groups``, which list the model's
parameters as ``configure_optimizers`` built them, in the order of the run that saved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.format import Toc, empty_toc, model_key, optimizer_key, tensor_info
from lightning_zero.checkpoint.storage import Location
from lightning_zero.sharding.activation_checkpointing import parameter_names
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


class FlatSource(Protocol):
    """A full tensor read by flat element ranges without being read whole (``pretrained.SafetensorsSlice``); a
    flattened ``Tensor`` is one too."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __getitem__(self, index: slice) -> Tensor:
        """Elements ``index`` of the flattened tensor."""
        ...


def state_dict_sources(state_dict: Mapping[str, Any], prefix: str, origin: Location) -> tuple[dict[str, Tensor], Toc]:
    """A full ``state_dict`` (keys relative to ``prefix``) as sources and a table of contents."""
    sources: dict[str, Tensor] = {}
    toc = empty_toc()
    for key, value in state_dict.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(
                f"State dict entry {key!r} of {origin} is a {type(value).__name__}, not a tensor. HINT: pass the "
                "model's state_dict (parameter and buffer names mapped to tensors)."
            )
        storage = model_key(prefix + key)
        sources[storage] = value.reshape(-1)
        toc["state_dict"][prefix + key] = storage
        toc["tensors"][storage] = tensor_info(value.shape, value.dtype, flat=True)
    return sources, toc


def full_checkpoint_sources(
    checkpoint: dict[str, Any], module: nn.Module, zero_optimizers: Sequence[ZeroOptimizer], origin: Location
) -> tuple[dict[str, Tensor], Toc]:
    """A full Lightning checkpoint's model state and, for each of ``zero_optimizers`` (none: skip), its optimizer
    state by parameter name.

    ``checkpoint`` keeps Lightning's other state; its ``state_dict`` is taken out and its ``optimizer_states`` keep
    only the param-group hyper-parameters, as in a sharded checkpoint. A ``WeightAveraging`` callback's checkpoint
    keeps its average as ``state_dict``, as ``load_checkpoint`` returns a sharded one's.
    """
    state_dict = checkpoint.pop("state_dict", None)
    live = checkpoint.pop("current_model_state", None)
    if isinstance(live, Mapping):  # Lightning's WeightAveraging saved the average as "state_dict", the weights here
        checkpoint["state_dict"], state_dict = state_dict, live
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"{origin} has no 'state_dict' mapping, so it is not a Lightning checkpoint. HINT: for plain weights, "
            "use lightning_zero.load_full_state_dict()."
        )
    sources, toc = state_dict_sources(state_dict, "", origin)
    optimizer_states = checkpoint.get("optimizer_states")
    if not optimizer_states:
        return sources, toc
    if zero_optimizers:
        if len(zero_optimizers) != len(optimizer_states):
            raise CheckpointError(
                f"{origin} holds the state of {len(optimizer_states)} optimizer(s), but configure_optimizers "
                f"returned {len(zero_optimizers)}. HINT: resume with the same optimizers."
            )
        # Names as state_dict() keys them: Note [checkpoint wrappers keep the names]
        names = parameter_names(module)
        shapes = {names[id(p)]: p.shape for p in module.parameters()}
        for i, (saved, zero) in enumerate(zip(optimizer_states, zero_optimizers, strict=True)):
            if saved is None:  # not loaded (Note [several models in one checkpoint] in sections.py)
                toc["optimizers"].append({})
                continue
            groups = [[names[id(p)] for p in group["params"]] for group in zero.param_groups]  # the user's order
            toc["optimizers"].append(_optimizer_sources(i, saved, groups, shapes, sources, toc, origin))
    checkpoint["optimizer_states"] = [
        None if saved is None else {"param_groups": saved["param_groups"]} for saved in optimizer_states
    ]
    return sources, toc


def _optimizer_sources(
    i: int,
    saved: Mapping[str, Any],
    groups: list[list[str]],
    shapes: Mapping[str, Any],
    sources: dict[str, Tensor],
    toc: Toc,
    origin: Location,
) -> dict[str, dict[str, str]]:
    """One torch optimizer ``state_dict()`` (state keyed by position) as sources keyed by parameter name."""
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"Optimizer {i} in {origin} has {len(saved_groups)} param groups; configure_optimizers now builds "
            f"{len(groups)}. HINT: build the same param groups as in the run that saved."
        )
    name_of: dict[int, str] = {}
    for g, (saved_group, names) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(saved_group["params"]) != len(names):
            raise CheckpointError(
                f"Param group {g} of optimizer {i} in {origin} has {len(saved_group['params'])} parameters; "
                f"configure_optimizers now puts {len(names)} there. HINT: build the same param groups as when saving."
            )
        name_of.update(zip(saved_group["params"], names, strict=True))
    state: Mapping[int, Mapping[str, Any]] = saved["state"]
    # A state name is element-wise if it has the parameter's shape somewhere (0-d parameters are ambiguous alone).
    elementwise = {n for entry in state.values() for n, v in entry.items() if isinstance(v, Tensor) and v.dim() > 0}
    storage_names: dict[str, dict[str, str]] = {}
    for position, entry in state.items():
        fqn = name_of.get(position)
        if fqn is None:
            raise CheckpointError(
                f"Optimizer {i} in {origin} has state for parameter position {position}, which no "
                "param group lists. HINT: the file is corrupted."
            )
        for name, value in entry.items():
            flat = name in elementwise
            if not isinstance(value, Tensor) or (flat and value.shape != shapes[fqn]):
                raise CheckpointError(
                    f"Optimizer {i} state {name!r} of {fqn!r} in {origin} is a {type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ()))}, expected a tensor of shape {tuple(shapes[fqn])} or a 0-d "
                    "tensor. HINT: ZeRO shards element-wise optimizers whose state is tensors."
                )
            storage = optimizer_key(i, fqn, name)
            sources[storage] = value.reshape(-1) if flat else value
            toc["tensors"][storage] = tensor_info(value.shape, value.dtype, flat)
            storage_names.setdefault(fqn, {})[name] = storage
    return storage_names
