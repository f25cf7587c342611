"""What Lightning's checkpoint hooks see of the model in a save, and what the save writes of what they left.

Note [checkpoint hooks see the model's values]
Lightning builds a checkpoint's dictionary, hands it to ``Callback.on_save_checkpoint`` and
``LightningModule.on_save_checkpoint``, and gives the strategy what they left to write. Hooks we did not write read
and edit ``checkpoint["state_dict"]``: they drop the frozen base's keys, rename keys, put an EMA's weights in, log a
norm or a hash of every weight, cast to half. Under DDP the entries are the model's tensors and the file holds what
the hooks left; under FSDP2's strategy they are DTensors (``Shard(0)`` rows), which DCP writes as they are left;
DeepSpeed's strategy writes its engine's own state and drops the dictionary's, so what a hook did there is lost.

Here every entry is a tensor with the model's values, handed out without a copy or a collective (``HookEntries``): a
replicated tensor (a buffer, a parameter no bucket holds) and, at stages 1 and 2, a sharded parameter are the live
tensors detached, as DDP's. At stage 3 a sharded parameter is, as ``lightning_module_state_dict()`` gives it, a
DTensor of its ``Shard(0)`` rows (``state_dict()``'s, Note [a stage-3 model's state dict] in ``module_state.py``), or
with ``state_dict_type="full"`` a full tensor as DDP's (FSDP's full state dict); either holds no memory
(``LazyEntry`` in ``lazy_entry.py``, the DTensor's local tensor or the entry itself) until an operation reads it:
then its bucket is gathered, collectively (``LazyValues``), and the rows of the bucket's parameters are kept until
the save ends, the full values one bucket at a time. A hook that reads every weight (a norm) holds about 1/N of the
model plus a bucket (one bucket, full); a hook that reads none costs nothing. Every rank reads them in the same order,
as with FSDP2's DTensors (a DTensor's norm is a collective; its ``float()`` is this rank's part, FSDP2's
``full_tensor()`` the whole); a rank reading alone fails within seconds, naming the fix (Note [one-rank calls]).

The save writes what the hooks left (``written_state``), deciding for each key:

- an entry as it was handed out (under its key, renamed, or under several keys), read or not, is written from the
  shards as if there were no hooks: each rank its owned ranges (``FlatChunk``s, through the memory tiers, nothing
  copied), with the exact fp32 master where the run keeps one;
- any other tensor (added, or replacing an entry: an EMA's weights, a cast) is written as it is, with no master, so
  a resume loads exactly it: a plain tensor whole by rank 0 (DDP's file holds rank 0's), a DTensor by every rank
  from its rows (``Shard(0)``) or by rank 0 (``Replicate``);
- a key the hooks removed is not written; anything but a tensor is refused (other state goes beside
  ``state_dict``).

An entry written into in place (``.mul_()``, ``.copy_()``) is refused, naming it, before anything is written: at stage
3 at the operation itself (or, through a view of values read, when the save begins), at stages 1 and 2 (where it is
the live parameter, which the next step overwrites from the masters: honouring it in the file would save other
weights than training goes on from) when the save begins. A hook replaces an entry instead.

The file follows rank 0's dictionary, as DDP's does: the ranks compare a digest of their decisions in one small
collective and, when they differ (a hook under ``rank_zero_only``), rank 0 sends its decisions and every rank writes
its ranges of what rank 0 kept; a DTensor rank 0 left needs every rank's rows, and is refused where a rank holds none
under that key. With ``exclude_frozen_parameters`` the frozen entries still as handed out are left out (and recorded,
with the frozen keys the hooks removed); ``state_dict_type="full"`` writes the same decisions as one file, a DTensor
made whole first.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.format import FlatChunk
from lightning_zero.checkpoint.frozen import frozen_keys
from lightning_zero.checkpoint.lazy_entry import HINT_REPLACE, LazyEntry, LazyValues
from lightning_zero.checkpoint.module_state import ModuleState, shard0_rows
from lightning_zero.checkpoint.slices import OwnedSlice, owned_parameter_slices
from lightning_zero.checkpoint.tiered import TierStorage, chunk_of
from lightning_zero.compat import (
    dtensor_over,
    local_tensor_of,
)
from lightning_zero.sharding.sharded_optimizer import ShardedParameters, ZeroOptimizer

__all__ = ["HookEntries", "Written", "written_state"]


class _Handed(NamedTuple):
    """One tensor of the model as the hooks got it."""

    key: str
    """The first key it was handed out under."""
    entry: Tensor
    version: int
    """``entry._version`` when handed out."""
    lazy: LazyEntry | None
    """Stage 3: the lazy values inside ``entry`` (``entry`` itself, or its DTensor's local tensor)."""
    tensor: Tensor
    """The module's own tensor (a parameter or a buffer)."""
    owned: OwnedSlice | None
    """This rank's range of it, if it is sharded."""


class Written(NamedTuple):
    """What this rank writes of the model's state the hooks left (Note [checkpoint hooks see the model's values])."""

    state: dict[str, FlatChunk | Tensor]
    """By key: this rank's ranges (``FlatChunk``) or a tensor; a key written by rank 0 alone is absent elsewhere."""
    masters: dict[str, str]
    """Key -> the parameter whose fp32 master holds the key's exact values (entries as handed out)."""
    excluded: list[str]
    """The frozen keys left out (``exclude_frozen_parameters``)."""
    params: dict[int, Tensor]
    """``id`` of each ``FlatChunk`` of ``state`` -> the parameter it is a range of."""
    as_left: set[int]
    """The ``id`` of each tensor of ``state`` that a hook left (written in its own dtype)."""


class HookEntries:
    """The model's state dict as the hooks of a save get it, and each entry's way back into the file (Note
    [checkpoint hooks see the model's values]). ``module_state``: the stage-3 model's, whose sharded parameters become
    lazy entries (DTensors of their rows, or with ``full`` full-shape tensors); None at stages 1 and 2."""

    def __init__(
        self,
        module: nn.Module,
        zero_optimizers: Sequence[ZeroOptimizer],
        gatherer: ShardedParameters | None,
        tiers: TierStorage | None,
        module_state: ModuleState | None,
        full: bool = False,
    ) -> None:
        self.module = module
        self.tiers = tiers
        self.handed: list[_Handed] = []
        self.state: dict[str, Tensor] = {}
        """What the hooks get as ``checkpoint["state_dict"]``."""
        self._index: dict[int, int] = {}  # id of an entry, or of its lazy values -> its position in ``handed``
        self._values = LazyValues(module_state, rows=not full) if module_state is not None else None
        self._dtypes = module_state.values_dtypes() if module_state is not None else {}
        by_param = {id(s.param): s for s in owned_parameter_slices(zero_optimizers, gatherer)}
        first: dict[int, int] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, Tensor):
                raise CheckpointError(
                    f"State dict entry {key!r} of {type(module).__name__} is a {type(value).__name__}; sharded "
                    "checkpoints hold tensors only. HINT: keep extra state in `on_save_checkpoint` instead."
                )
            if id(value) not in first:  # tied names share one entry, as they share one tensor
                first[id(value)] = len(self.handed)
                owned = by_param.get(id(value))
                lazy = module_state is not None and owned is not None and id(value) in module_state.sharded
                handed = self._lazy(key, value, owned, module_state) if lazy else self._live(key, value, owned)
                self._index[id(handed.entry)] = len(self.handed)
                if handed.lazy is not None:
                    self._index[id(handed.lazy)] = len(self.handed)
                self.handed.append(handed)
            self.state[key] = self.handed[first[id(value)]].entry

    @staticmethod
    def _live(key: str, value: Tensor, owned: OwnedSlice | None) -> _Handed:
        entry = value.detach()  # shares the version counter: a write in place shows
        return _Handed(key, entry, entry._version, None, value, owned)

    def _lazy(self, key: str, param: Tensor, owned: Any, module_state: Any) -> _Handed:
        assert isinstance(owned, OwnedSlice), "a sharded parameter"
        assert isinstance(module_state, ModuleState), "stage 3"
        assert self._values is not None, "stage 3"
        self._values.keys[id(param)] = key
        shape, dtype = owned.shape, self._dtypes[id(param)]
        like = torch.empty(0, device=module_state.bucket_of(param).device)  # the gathered values' device
        if not self._values.rows:  # state_dict_type="full": the full tensor, as DDP's
            whole = LazyEntry(like, shape, dtype, self._values, param, key)
            return _Handed(key, whole, whole._version, whole, param, owned)
        group = module_state.gatherer.group
        rows_shape: torch.Size
        placement: Shard | Replicate
        if len(shape) == 0:
            rows_shape, placement = shape, Replicate()
        else:
            start, stop = shard0_rows(shape[0], group.rank(), group.size())
            rows_shape, placement = torch.Size([stop - start, *shape[1:]]), Shard(0)
        rows = LazyEntry(like, rows_shape, dtype, self._values, param, key)
        entry = dtensor_over(rows, module_state.mesh(like.device), [placement], shape)
        return _Handed(key, entry, entry._version, rows, param, owned)

    def release(self) -> None:
        """Drop the values read (the save is over)."""
        if self._values is not None:
            self._values.release()

    # -- what the hooks left ----------------------------------------------------------------------------------------
    def decide(self, state: Mapping[str, Any]) -> tuple[list[tuple[str, str, Any]], str | None]:
        """``(key, kind, detail)`` for each key the hooks left: ``("entry", position)`` for an entry as handed out,
        ``("tensor", None)``, ``("dtensor", (shape, dtype, placement))``; and the first refusal, if any."""
        error = self._written_in_place()
        decisions: list[tuple[str, str, Any]] = []
        for key, value in state.items():
            position = self._ours(value)
            if position is not None:
                decisions.append((key, "entry", position))
            elif isinstance(value, DTensor):
                refusal = _dtensor_refusal(key, value)
                error = error or refusal
                decisions.append((key, "dtensor", (tuple(value.shape), str(value.dtype), str(value.placements))))
            elif isinstance(value, Tensor):
                decisions.append((key, "tensor", None))
            else:
                error = error or (
                    f"checkpoint['state_dict'][{key!r}] is a {type(value).__name__} after the checkpoint hooks; a "
                    "model's state dict holds tensors. HINT: keep other state beside it, e.g. "
                    f"`checkpoint[{key!r}] = ...` in `on_save_checkpoint`."
                )
        return decisions, error

    def _ours(self, value: Any) -> int | None:
        position = self._index.get(id(value))
        if position is None and isinstance(value, DTensor):  # a new DTensor over an entry's rows (`.detach()`)
            position = self._index.get(id(local_tensor_of(value)))
            if position is not None and value.shape != self.handed[position].entry.shape:
                position = None
        return position

    def _written_in_place(self) -> str | None:
        through_view = self._values.written() if self._values is not None else None
        for handed in self.handed:
            if handed.entry._version != handed.version or through_view == handed.key:
                live = "" if handed.lazy is not None else " (the live tensor: this rank's model changed too)"
                return (
                    f"A checkpoint hook wrote into checkpoint['state_dict'][{handed.key!r}] in place{live}; the save "
                    "writes an entry left as handed out from the shards, so "
                    f"the file would not hold what the hook left (Note [checkpoint hooks see the model's values]). "
                    f"{HINT_REPLACE}"
                )
        return None

    def refusal_to_follow(self, decisions: list[tuple[str, str, Any]], state: Mapping[str, Any]) -> str | None:
        """Whether this rank can write rank 0's ``decisions``: a DTensor rank 0 left needs this rank's rows."""
        for key, kind, detail in decisions:
            if kind != "dtensor":
                continue
            value = state.get(key)
            mine = (tuple(value.shape), str(value.dtype), str(value.placements)) if isinstance(value, DTensor) else None
            if mine != detail:
                return (
                    f"checkpoint['state_dict'][{key!r}] is a DTensor {detail} on rank 0 after the checkpoint hooks, "
                    f"but {'a ' + type(value).__name__ if mine is None else 'a DTensor ' + str(mine)} on another "
                    "rank: a DTensor is written from every rank's rows. HINT: run the hook on every rank (not under "
                    "`rank_zero_only`), or put a whole tensor there (`.full_tensor()` on every rank)."
                )
        return None

    def build(
        self,
        decisions: list[tuple[str, str, Any]],
        state: Mapping[str, Any],
        rank: int,
        *,
        exclude_frozen: bool,
        full: bool,
    ) -> Written:
        """What this rank writes for ``decisions`` (rank 0's, which every rank follows)."""
        out: dict[str, FlatChunk | Tensor] = {}
        masters: dict[str, str] = {}
        excluded: list[str] = []
        params: dict[int, Tensor] = {}
        as_left: set[int] = set()
        made: dict[int, FlatChunk | Tensor] = {}
        for key, kind, detail in decisions:
            if kind == "entry":
                handed = self.handed[detail]
                if exclude_frozen and isinstance(handed.tensor, nn.Parameter) and not handed.tensor.requires_grad:
                    excluded.append(key)  # Note [frozen base restored from its source]
                    continue
                if detail not in made:
                    owned = handed.owned
                    if owned is None:
                        made[detail] = handed.tensor.detach()
                    else:
                        made[detail] = chunk_of(owned.values_span, owned.start, owned.shape, self.tiers)
                        params[id(made[detail])] = handed.tensor
                out[key] = made[detail]
                if handed.owned is not None:
                    masters[key] = handed.owned.fqn
            elif kind == "tensor":
                if rank == 0:  # as DDP's file holds rank 0's
                    out[key] = state[key].detach()
            elif full:  # a DTensor, made whole on every rank (collective, in rank 0's order)
                whole = state[key].detach().full_tensor()
                if rank == 0:
                    out[key] = whole
            else:
                written = _dtensor_written(state[key].detach(), rank)
                if written is not None:
                    out[key] = written
            if kind != "entry" and key in out:
                as_left.add(id(out[key]))
        dropped = [k for k in frozen_keys(self.module) if k not in {d[0] for d in decisions}]
        return Written(out, masters, excluded + dropped if exclude_frozen else excluded, params, as_left)


def _dtensor_refusal(key: str, value: DTensor) -> str | None:
    mesh = value.device_mesh
    placement = value.placements[0] if len(value.placements) == 1 else None
    if mesh.ndim == 1 and (isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)):
        return None
    return (
        f"checkpoint['state_dict'][{key!r}] is a DTensor placed {value.placements} on a {mesh.ndim}-D mesh after the "
        "checkpoint hooks; a sharded checkpoint writes DTensors sharded on rows (Shard(0)) or replicated over a 1-D "
        "mesh. HINT: put `.full_tensor()` of it there (on every rank), or redistribute it to Shard(0)."
    )


def _dtensor_written(value: DTensor, rank: int) -> FlatChunk | Tensor | None:
    """What this rank writes of a DTensor the hooks left: its rows as a range of the flattened tensor (``Shard(0)``),
    or the whole local tensor on rank 0 (``Replicate``)."""
    local = local_tensor_of(value)
    if isinstance(value.placements[0], Replicate):
        return local if rank == 0 else None
    mesh = value.device_mesh
    start, stop = shard0_rows(value.shape[0], mesh.get_local_rank(), mesh.size())
    row = value.shape[1:].numel()
    assert local.shape[0] == stop - start, "Shard(0) splits rows as torch.chunk does"
    return FlatChunk(local.contiguous().reshape(-1), start * row, value.shape)


def written_state(
    entries: HookEntries,
    state: Any,
    group: dist.ProcessGroup | None,
    *,
    exclude_frozen: bool,
    full: bool,
) -> Written:
    """What this rank writes of ``state``, the model's state dict the checkpoint hooks left, following rank 0's
    (Note [checkpoint hooks see the model's values]); a refusal on any rank is raised on every rank, before anything is
    written. Collective over ``group``: one small object exchange, two when the ranks' decisions differ."""
    state = {} if state is None else state
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"checkpoint['state_dict'] is a {type(state).__name__} after the checkpoint hooks, not a mapping of "
            "names to tensors. HINT: edit the dictionary's entries, or replace it with a dict."
        )
    decisions, error = entries.decide(state)
    rank = 0 if group is None else group.rank()
    if group is not None and group.size() > 1:
        digest = hashlib.sha256(pickle.dumps(decisions)).hexdigest()
        every: list[Any] = [None] * group.size()
        dist.all_gather_object(every, (digest, error), group=group)
        _raise_first([e for _, e in every])
        if any(d != every[0][0] for d, _ in every):  # a hook under rank_zero_only: rank 0's decisions are the file's
            box: list[Any] = [decisions if rank == 0 else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            decisions = box[0]
            refusals: list[Any] = [None] * group.size()
            dist.all_gather_object(refusals, entries.refusal_to_follow(decisions, state), group=group)
            _raise_first(refusals)
    else:
        _raise_first([error])
    return entries.build(decisions, state, rank, exclude_frozen=exclude_frozen, full=full)


def _raise_first(errors: list[str | None]) -> None:
    first = next((e for e in errors if e), None)
    if first is not None:
        raise CheckpointError(f"Nothing was saved: {first}")
