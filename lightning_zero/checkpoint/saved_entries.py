"""What ``on_load_checkpoint`` sees of the model in a checkpoint, and the load of what it left.

Note [on_load_checkpoint edits what loads]
Lightning reads a checkpoint (``strategy.load_checkpoint``), hands it to ``LightningModule.on_load_checkpoint``, and
then has the strategy load the model from ``checkpoint["state_dict"]`` (``load_model_state_dict``, with the module's
``strict_loading``). Hooks remap keys there (a model whose modules were renamed between versions), drop or add keys
(a new head), replace values. DDP loads what the hook left; FSDP's and DeepSpeed's strategies load the weights inside
``load_checkpoint``, before the hook, which finds no ``state_dict`` to edit.

Here ``load_checkpoint`` reads Lightning's state and the table of contents only, and gives as ``state_dict`` the
checkpoint's entries, each a tensor of the saved shape and dtype without memory (``SavedTensor``) that reads itself
whole from the files when an operation first uses it, by this rank alone (no collective: a hook may read on one rank);
a one-file checkpoint's entries are its memory-mapped tensors. ``load_model_state_dict`` then loads the dictionary as
the hook left it (``load_edited``): an entry as it was read, under its key or another, streams into this rank's shards
as a load without hooks does (its owned ranges only, the exact fp32 master where the save kept one, through the memory
tiers); a tensor the hook put there or wrote into is loaded from memory (a DTensor made whole first); with
``strict_loading`` the keys must be the model's, and a missing or unexpected key is refused before anything loads.
Optimizer state is keyed by parameter name, so an entry the hook renamed (and maybe wrote into) takes its parameter's
optimizer state along, as DDP's positional optimizer state does; an entry moved and then replaced by a new tensor
says nothing of where it came from, so resuming a fit from it is refused, naming the fix. The ranks compare a digest
of what they load (one small collective: each key with the saved entry it loads as read, or the shape and dtype of a
tensor the hook left, not its values) and refuse dictionaries that differ between ranks (a hook under
``rank_zero_only``), which would load a model half edited. A checkpoint holding a ``WeightAveraging`` average, and
pretrained weights, load inside ``load_checkpoint`` as before (Note [Lightning's WeightAveraging]).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from os import PathLike
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.files import CheckpointError, load_lightning_state
from lightning_zero.checkpoint.format import Toc, info_dtype, open_committed, tensor_info
from lightning_zero.checkpoint.full_weights import refresh_gathered
from lightning_zero.checkpoint.pretrained import is_pretrained_source
from lightning_zero.checkpoint.sharded_checkpoint import (
    load_checkpoint,
    load_full_checkpoint,
    ready_to_read,
    restore_frozen,
)
from lightning_zero.checkpoint.slices import LoadPlan, owned_parameter_slices, read_whole
from lightning_zero.checkpoint.storage import Location
from lightning_zero.checkpoint.tiered import TierStorage
from lightning_zero.compat import disabled_torch_function_impl, make_wrapper_subclass, tree_map
from lightning_zero.sharding.sharded_optimizer import ShardedParameters, ZeroOptimizer

__all__ = ["PendingLoad", "SavedTensor", "load_edited", "read_for_hooks"]

_WEIGHT_AVERAGING_LIVE = "current_model_state"


class SavedTensor(Tensor):
    """A tensor of a sharded checkpoint as ``on_load_checkpoint`` sees it: the saved shape and dtype, no memory until
    an operation uses it, then read whole by this rank (Note [on_load_checkpoint edits what loads])."""

    _read: Callable[[], Tensor]
    _whole: Tensor | None
    _whole_version: int | None
    storage_key: str
    """Its storage key in the checkpoint."""
    saved_key: str
    """The key it was saved under."""

    @staticmethod
    def __new__(
        cls: type[SavedTensor], info: Mapping[str, Any], storage: str, key: str, read: Callable[[], Tensor]
    ) -> SavedTensor:
        made = make_wrapper_subclass(cls, torch.empty(0), torch.Size(info["shape"]), info_dtype(info))
        assert isinstance(made, SavedTensor)
        made._read, made._whole, made._whole_version, made.storage_key, made.saved_key = read, None, 0, storage, key
        return made

    def __repr__(self) -> str:  # type: ignore[override]
        read = self._whole is not None
        return f"SavedTensor({self.saved_key!r}, shape={tuple(self.shape)}, dtype={self.dtype}, read={read})"

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # `.detach()`, `.data`: not read
            return args[0]
        read: Callable[[Any], Any] = lambda x: x.whole() if isinstance(x, SavedTensor) else x  # noqa: E731
        return func(*tree_map(read, args), **tree_map(read, kwargs or {}))

    def whole(self) -> Tensor:
        """The saved tensor, read by this rank alone the first time."""
        if self._whole is None:
            self._whole = self._read()
            self._whole_version = _version(self._whole)
        return self._whole

    @property
    def written(self) -> bool:
        """Whether the hook wrote into it (in place, or through a view of the values read): then it loads from
        memory. A write into this tensor moves its own version, not its values' (``__torch_dispatch__`` runs below
        the version counting); an inference tensor (``trainer.test``/``predict`` restore under inference mode) counts
        none, so there a read counts as a write."""
        if self._whole is None:
            return False
        versions = (_version(self), self._whole_version, _version(self._whole))
        return None in versions or versions[0] != 0 or versions[1] != versions[2]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.whole().__reduce_ex__(protocol)


class PendingLoad(NamedTuple):
    """A checkpoint read by ``read_for_hooks`` whose model and optimizer state load once the hook has run."""

    origin: Location
    module: nn.Module
    zero_optimizers: Sequence[ZeroOptimizer]
    process_group: dist.ProcessGroup | None
    load_optimizer: bool
    gatherer: ShardedParameters | None
    tiers: TierStorage | None
    built_on_meta: bool
    toc: Toc | None
    """None: a one-file checkpoint."""
    data: Location | None
    metadata: Metadata | None
    file_entries: dict[int, tuple[str, Tensor, int | None]] | None = None
    """A one-file checkpoint's: by ``id`` of each memory-mapped entry, its key, itself (kept, so the ``id`` is not
    reused) and its version then (None for an inference tensor, which tracks none: a write in place under
    ``trainer.test``/``predict`` is then not told apart); what the ranks compare of an entry left as it was read."""


def read_for_hooks(
    path: str | PathLike[str],
    module: nn.Module,
    zero_optimizers: Sequence[ZeroOptimizer],
    process_group: dist.ProcessGroup | None,
    *,
    load_optimizer: bool,
    strict: bool,
    gatherer: ShardedParameters | None,
    tiers: TierStorage | None,
    built_on_meta: bool,
) -> tuple[dict[str, Any], PendingLoad | None]:
    """``load_checkpoint``'s first half (Note [on_load_checkpoint edits what loads]): Lightning's state, whose
    ``state_dict`` the hook may edit, and what ``load_edited`` loads it with; or, for pretrained weights and a
    ``WeightAveraging`` checkpoint, everything loaded now and no pending load. Collective."""
    origin = ready_to_read(path, process_group)

    def now() -> tuple[dict[str, Any], None]:
        state = load_checkpoint(
            path, module, zero_optimizers, process_group, load_optimizer=load_optimizer, strict=strict,
            gatherer=gatherer, tiers=tiers, built_on_meta=built_on_meta,
        )  # fmt: skip
        return state, None

    if is_pretrained_source(origin):
        return now()
    pending = PendingLoad(
        origin, module, zero_optimizers, process_group, load_optimizer, gatherer, tiers, built_on_meta, None, None, None
    )
    if origin.isfile():  # a full checkpoint: its entries are memory-mapped tensors already
        state = load_lightning_state(origin, mmap=True)
        if isinstance(state.get(_WEIGHT_AVERAGING_LIVE), Mapping):
            return now()
        saved = state.get("state_dict")
        saved = saved if isinstance(saved, Mapping) else {}
        files = {id(v): (k, v, _version(v)) for k, v in saved.items() if isinstance(v, Tensor)}
        return state, pending._replace(file_entries=files)
    state, toc, data, metadata = open_committed(origin)
    if toc.get("averaged"):
        return now()
    entries: dict[str, SavedTensor] = {}
    by_storage: dict[str, SavedTensor] = {}
    for key, storage in toc["state_dict"].items():
        if storage not in by_storage:  # tied names: one tensor

            def read(storage: str = storage, key: str = key) -> Tensor:
                return read_whole(data, metadata, toc, {key: storage}, None)[key]

            by_storage[storage] = SavedTensor(toc["tensors"][storage], storage, key, read)
        entries[key] = by_storage[storage]
    state["state_dict"] = entries
    return state, pending._replace(toc=toc, data=data, metadata=metadata)


def load_edited(pending: PendingLoad, checkpoint: dict[str, Any], strict: bool) -> None:
    """Load the model (and, if asked, the optimizers) from ``checkpoint["state_dict"]`` as ``on_load_checkpoint``
    left it (Note [on_load_checkpoint edits what loads]). Collective."""
    state_dict = checkpoint.get("state_dict")
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"checkpoint['state_dict'] is a {type(state_dict).__name__} after `on_load_checkpoint`, not the model's "
            f"state dict, so {pending.origin} cannot be loaded. HINT: edit the dictionary's entries, or replace it "
            "with a dict of the model's keys."
        )
    module_state = pending.module.state_dict(keep_vars=True)
    kinds: list[tuple[str, str, Any]] = []
    used: dict[str, str] = {}  # storage -> the first key loading it
    files = pending.file_entries or {}
    for key, value in state_dict.items():
        in_file = files.get(id(value))
        if in_file is not None and in_file[1] is value and _version(value) == in_file[2]:  # as read from the file
            kinds.append((key, "saved", in_file[0]))
            continue
        if isinstance(value, SavedTensor) and not value.written:
            first = used.setdefault(value.storage_key, key)
            if first == key or module_state.get(first) is module_state.get(key):  # tied in the model too
                kinds.append((key, "saved", value.storage_key))
                continue
        if isinstance(value, DTensor):
            kinds.append((key, "dtensor", (tuple(value.shape), str(value.dtype))))
        elif isinstance(value, Tensor):
            kinds.append((key, "tensor", (tuple(value.shape), str(value.dtype))))
        else:
            raise CheckpointError(
                f"checkpoint['state_dict'][{key!r}] is a {type(value).__name__} after `on_load_checkpoint`; the model "
                "loads tensors. HINT: remove the entry, or put a tensor of the model's key there."
            )
    _agree(kinds, pending.process_group)
    if pending.toc is None:
        _load_one_file(pending, checkpoint, state_dict, strict)
        return
    toc = pending.toc
    assert pending.data is not None, "a sharded checkpoint's files"
    assert pending.metadata is not None, "a sharded checkpoint's files"
    mapping: dict[str, str] = {}
    memory: dict[str, Tensor] = {}
    tensors = dict(toc["tensors"])
    renamed: dict[str, str] = {}
    for key, kind, detail in kinds:
        value = state_dict[key]
        if isinstance(value, SavedTensor) and (
            value.saved_key not in state_dict or state_dict[value.saved_key] is not value  # moved, not tied
        ):
            renamed.setdefault(value.saved_key, key)  # also when written into: it keeps its optimizer state
        if kind == "saved":
            mapping[key] = detail
            continue
        if kind == "dtensor":
            value = value.full_tensor()  # collective, in the order every rank agreed on
        elif isinstance(value, SavedTensor):
            value = value.whole()
        storage = f"memory/{key}"
        memory[storage] = value.detach().reshape(-1)
        tensors[storage] = tensor_info(value.shape, value.dtype, flat=True)
        mapping[key] = storage
    optimizers = [{renamed.get(fqn, fqn): names for fqn, names in o.items()} for o in toc["optimizers"]]
    if pending.load_optimizer:
        _refuse_lost_optimizer_state(pending, module_state, mapping, optimizers)
    edited = {**toc, "state_dict": mapping, "tensors": tensors, "optimizers": optimizers}
    module, zero_optimizers = pending.module, pending.zero_optimizers
    excluded = restore_frozen(
        checkpoint, module, pending.origin, zero_optimizers, pending.gatherer, pending.tiers, pending.built_on_meta
    )
    slices = owned_parameter_slices(zero_optimizers, pending.gatherer)
    origin, tiers = pending.origin, pending.tiers
    plan = LoadPlan(module, slices, edited, strict=strict, origin=origin, tiers=tiers, excluded=excluded)
    if pending.load_optimizer and toc["optimizers"]:
        plan.add_optimizers(zero_optimizers, checkpoint.get("optimizer_states"))
    plan.read_dcp(pending.data, pending.metadata, pending.process_group, memory)
    plan.finish(zero_optimizers)
    refresh_gathered(pending.gatherer)


def _load_one_file(
    pending: PendingLoad, checkpoint: dict[str, Any], state_dict: Mapping[str, Any], strict: bool
) -> None:
    """A full checkpoint's dictionary as the hook left it, loaded as a DDP run's file is."""
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state_dict.items()}
    checkpoint["state_dict"] = full
    try:
        load_full_checkpoint(
            checkpoint, pending.origin, pending.module, pending.zero_optimizers, load_optimizer=pending.load_optimizer,
            strict=strict, gatherer=pending.gatherer, tiers=pending.tiers, built_on_meta=pending.built_on_meta,
        )  # fmt: skip
    finally:
        checkpoint["state_dict"] = state_dict  # what the hook left, for the callbacks' hooks after it


def _refuse_lost_optimizer_state(
    pending: PendingLoad, module_state: Mapping[str, Any], mapping: Mapping[str, str], optimizers: list[Any]
) -> None:
    """Refuse, before anything loads, a trainable parameter the hook gave a new tensor under a key with no optimizer
    state while state saved under another key fits no parameter: the hook moved the entry and then replaced it, so
    nothing says whose state it is (DDP's, positional, follows the parameter). Same on every rank (the agreed
    dictionary, the model's keys and the table of contents)."""
    with_state = {fqn for names in optimizers for fqn in names}
    orphans = sorted(with_state - set(module_state))
    lost = [
        key
        for key, storage in mapping.items()
        if storage.startswith("memory/") and key not in with_state
        and isinstance(module_state.get(key), nn.Parameter) and module_state[key].requires_grad
    ]  # fmt: skip
    if orphans and lost:
        raise CheckpointError(
            f"`on_load_checkpoint` put a new tensor under checkpoint['state_dict'][{lost[0]!r}], which has no "
            f"optimizer state in {pending.origin}, while the state saved for {orphans[0]!r} fits no parameter: the "
            "optimizer state follows an entry by the key it was saved under, and a replaced entry no longer says "
            "where it came from. HINT: write the new values into the moved entry in place "
            "(`state[new_key].copy_(values)`), which keeps its optimizer state, or resume weights only."
        )


def _agree(kinds: list[tuple[str, str, Any]], group: dist.ProcessGroup | None) -> None:
    """Refuse on every rank when the ranks would load different dictionaries."""
    if group is None or group.size() == 1:
        return
    digest = hashlib.sha256(pickle.dumps(kinds)).hexdigest()
    every: list[Any] = [None] * group.size()
    dist.all_gather_object(every, digest, group=group)
    if any(d != every[0] for d in every):
        differing = [r for r, d in enumerate(every) if d != every[0]]
        raise CheckpointError(
            f"`on_load_checkpoint` left a different checkpoint['state_dict'] on rank(s) {differing} than on rank 0 "
            "(other keys, or other kinds or shapes of tensors): each rank loads its shards from its own, so the model "
            "would be loaded half edited. HINT: run the hook on every rank (not under `rank_zero_only`), "
            "deterministically."
        )


def _version(tensor: Tensor) -> int | None:
    """``tensor._version``, or None for an inference tensor (which has no version counter)."""
    return None if tensor.is_inference() else tensor._version
