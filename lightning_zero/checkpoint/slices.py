"""What this rank owns of each parameter, and the plan that fills exactly that from a checkpoint.

``owned_parameter_slices`` is the one place that knows the sharded layout: for every parameter held in a bucket, the
range ``[start, stop)`` of the flattened parameter in this rank's shard (a rank's shard of a bucket is contiguous, so
there is at most one), where its values are, and where its fp32 master and optimizer state live. Saving writes these
ranges; ``LoadPlan`` asks for the same ranges of the saved tensors, whatever layout saved them. Every place is a
``Span`` (a tensor and a range), since a memory tier may hold the tensor's memory (Note [checkpoints stream through
the tiers] in ``tiered.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_zero.checkpoint.files import CheckpointError, SafeReader
from lightning_zero.checkpoint.format import FlatChunk, SafeLoadPlanner, Toc, info_dtype
from lightning_zero.checkpoint.full import FlatSource
from lightning_zero.checkpoint.storage import Location
from lightning_zero.checkpoint.tiered import Span, TierStorage, chunk_of
from lightning_zero.compat import dcp_load
from lightning_zero.sharding.sharded_optimizer import ShardedParameters, ZeroOptimizer


class OwnedSlice(NamedTuple):
    """Elements ``[start, stop)`` of the flattened parameter ``fqn`` that this rank owns (empty when none)."""

    fqn: str
    param: nn.Parameter
    shape: torch.Size
    """The full parameter's shape."""
    start: int
    stop: int
    shard: Tensor
    """The bucket's persistent ``param_shard``; this rank's values are ``shard[shard_offset:][:stop - start]``."""
    shard_offset: int
    optimizer: int | None
    """Index of the ZeroOptimizer that steps these elements; None for frozen parameters."""
    state_key: Tensor | None
    """The master tensor that keys these elements' optimizer state (one per parameter: Note [one master per
    parameter]); the fp32 masters are ``state_key[state_offset:][:stop - start]``."""
    state_offset: int
    """Where the master starts inside ``state_key`` (and inside each element-wise optimizer state tensor)."""

    @property
    def values_span(self) -> Span:
        return Span(self.shard, self.shard_offset, self.stop - self.start)

    @property
    def master_span(self) -> Span | None:
        return None if self.state_key is None else Span(self.state_key, self.state_offset, self.stop - self.start)

    @property
    def values(self) -> Tensor:
        """(stop - start,) this rank's parameter values: a view of the shard (in memory only)."""
        return self.values_span.view()

    @property
    def master(self) -> Tensor | None:
        """(stop - start,) the fp32 master weights (``values`` itself when the parameters are fp32; in memory)."""
        span = self.master_span
        return None if span is None else span.view()

    @property
    def own_master(self) -> bool:
        """Whether the master holds values the parameters cannot (fp32 masters of low-precision parameters)."""
        return self.state_key is not None and self.state_key.dtype != self.shard.dtype

    @property
    def separate_master(self) -> bool:
        """Whether the master is other memory than the parameter values (a load writes both)."""
        return self.state_key is not None and not _same_storage(self.state_key, self.shard)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)


def owned_parameter_slices(
    zero_optimizers: Sequence[ZeroOptimizer], gatherer: ShardedParameters | None = None
) -> list[OwnedSlice]:
    """One ``OwnedSlice`` per sharded parameter (possibly empty): the only place that knows the sharded layout.

    The buckets are the optimizers' (stages 1 and 2) or, with a stage-3 ``gatherer``, every bucket of the sharded
    model, frozen ones included. A parameter held in no bucket is replicated: every rank has all of it (frozen
    parameters in stages 1 and 2, or every parameter when no optimizer was set up, e.g. under ``trainer.validate``).
    """
    gatherer = gatherer or next((z.gatherer for z in zero_optimizers if z.gatherer is not None), None)
    held = [b for z in zero_optimizers for b in z.buckets]
    if gatherer is not None:
        held = gatherer.all_buckets()
    buckets = {id(b): b for b in held}
    owners: dict[int, list[tuple[int, int, int, Tensor]]] = {}  # bucket -> (optimizer, start, stop, master)
    for i, zero in enumerate(zero_optimizers):
        for segment, master in zip(zero.segments, zero.masters, strict=True):
            owners.setdefault(id(segment.bucket), []).append((i, segment.start, segment.stop, master))
    slices: list[OwnedSlice] = []
    for bucket in buckets.values():
        lo, hi = bucket.rank * bucket.shard_numel, (bucket.rank + 1) * bucket.shard_numel
        shard = bucket.param_shard  # (shard_numel,) in the bucket's coordinates [lo, hi); maybe in a tier
        for slot, param in bucket.slots_and_params():
            first, last = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if first >= last:
                slices.append(OwnedSlice(slot.fqn, param, slot.shape, 0, 0, shard, 0, None, None, 0))
                continue
            a, b = first - lo, last - lo  # within the shard
            start, stop = first - slot.offset, last - slot.offset
            owned = OwnedSlice(slot.fqn, param, slot.shape, start, stop, shard, a, None, None, 0)
            for i, seg_start, seg_stop, master in owners.get(id(bucket), ()):
                if seg_start <= a and b <= seg_stop:  # the segment of this param group that holds the parameter
                    owned = owned._replace(optimizer=i, state_key=master, state_offset=a - seg_start)
            slices.append(owned)
    return slices


class LoadPlan:
    """Every destination this rank fills, keyed by the storage key it is read from, and what to do afterwards:
    a ``FlatChunk`` for a range of a flattened tensor (``SpanChunk`` through the memory ``tiers``), a tensor for a
    whole unflattened one. ``excluded``: entries the checkpoint left out on purpose (Note [frozen base restored from
    its source] in ``frozen.py``)."""

    def __init__(
        self,
        module: nn.Module,
        slices: list[OwnedSlice],
        toc: Toc,
        *,
        strict: bool,
        origin: Location,
        prefix: str = "",
        tiers: TierStorage | None = None,
        excluded: Collection[str] = (),
    ) -> None:
        self.slices = slices
        self.toc = toc
        self.origin = origin
        self.tiers = tiers
        self.reads: dict[str, FlatChunk | Tensor] = {}
        self.after: list[Callable[[], object]] = []
        by_param = {id(s.param): s for s in slices}
        module_state = {k: v for k, v in module.state_dict(keep_vars=True).items() if k.startswith(prefix)}
        present = set(toc["state_dict"]) | set(excluded)  # excluded: frozen, restored from their source
        _check_keys(type(module).__name__, set(module_state), present, strict, origin)
        placed: set[int] = set()
        for key, value in module_state.items():
            storage = toc["state_dict"].get(key)
            if storage is None or id(value) in placed:  # absent (strict=False) or tied to an earlier key
                continue
            placed.add(id(value))
            s = by_param.get(id(value))
            saved = torch.Size(toc["tensors"][storage]["shape"])
            if saved != (value.shape if s is None else s.shape):
                raise CheckpointError(
                    f"Shape mismatch for {key!r}: {origin} has {tuple(saved)}, the model has "
                    f"{tuple(value.shape if s is None else s.shape)}. HINT: the checkpoint comes from a different "
                    "model configuration."
                )
            source = toc["masters"].get(storage, storage)  # the exact fp32 values when they were saved
            if s is None:
                self._add(source, self._whole(value.detach()), key)
            elif s.stop > s.start:
                values, master = s.values_span, s.master_span
                # The fp32 master takes the exact saved values and the low-precision shard their rounding; a master
                # kept apart in the same dtype (the host tier's) takes the parameter's.
                target, mirror = (master, values) if s.own_master and master is not None else (values, master)
                self._add(source, chunk_of(target, s.start, s.shape, tiers, mirror if s.separate_master else None), key)

    def _add(self, source: str, read: FlatChunk | Tensor, key: str) -> None:
        if source in self.reads:
            raise CheckpointError(
                f"{self.origin} stores {key!r} as the same tensor as another parameter (tied weights), but the model "
                "has separate parameters. HINT: tie them in the model as in the run that saved."
            )
        self.reads[source] = read

    def _whole(self, tensor: Tensor) -> FlatChunk:
        if tensor.is_contiguous():
            return FlatChunk(tensor.view(-1), 0, tensor.shape)
        staging = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        self.after.append(lambda: tensor.copy_(staging.view(tensor.shape)))
        return FlatChunk(staging, 0, tensor.shape)

    def add_optimizers(self, zero_optimizers: Sequence[ZeroOptimizer], saved: list[Any] | None) -> None:
        if len(self.toc["optimizers"]) != len(zero_optimizers) or saved is None or len(saved) != len(zero_optimizers):
            raise CheckpointError(
                f"{self.origin} holds the state of {len(self.toc['optimizers'])} optimizer(s), but "
                f"configure_optimizers returned {len(zero_optimizers)}. HINT: resume with the same optimizers."
            )
        for i, zero in enumerate(zero_optimizers):
            if saved[i] is not None:  # None: not loaded (Note [several models in one checkpoint] in sections.py)
                self.after.append(self._plan_optimizer(i, zero, saved[i]["param_groups"]))

    def _plan_optimizer(self, i: int, zero: ZeroOptimizer, saved_groups: list[dict[str, Any]]) -> Callable[[], None]:
        """Read optimizer ``i``'s state for every owned range into per-segment tensors; load them afterwards."""
        names = self.toc["optimizers"][i]
        state: dict[int, dict[str, Tensor]] = {}  # id(segment master) -> state name -> tensor being filled
        for s in self.slices:
            if s.optimizer != i or s.state_key is None:
                continue
            entry = state.setdefault(id(s.state_key), {})
            for name, storage in names.get(s.fqn, {}).items():
                info = self.toc["tensors"][storage]
                if info["flat"]:  # element-wise: this range of the segment's tensor
                    if name not in entry:
                        entry[name] = self._new_state(zero, s.state_key, name)
                    span = Span(entry[name], s.state_offset, s.stop - s.start)
                    self.reads[storage] = chunk_of(span, s.start, s.shape, self.tiers)
                elif name not in entry:  # one value per segment, read from its first parameter
                    entry[name] = torch.empty(info["shape"], dtype=info_dtype(info))
                    self.reads[storage] = entry[name]
        groups = zero.optimizer.param_groups  # the wrapped optimizer's own groups: their params are the masters
        if len(saved_groups) != len(groups):
            raise CheckpointError(
                f"Optimizer {i} has {len(groups)} param groups, but {self.origin} saved "
                f"{len(saved_groups)}. HINT: configure_optimizers must build the same param groups as when saving."
            )

        def load() -> None:
            params = [p for group in groups for p in group["params"]]
            index = {id(p): k for k, p in enumerate(params)}
            filled = {index[key]: entry for key, entry in state.items() if entry}
            # A segment whose parameters never had a gradient in a full checkpoint lacks the 0-d entries (step):
            # it shares the optimizer's count, as every segment of a ZeRO run does.
            shared = {n: t for entry in filled.values() for n, t in entry.items() if t.dim() == 0}
            for entry in filled.values():
                for name, value in shared.items():
                    entry.setdefault(name, value.clone())
            restored = [
                {**_hyper_parameters(saved), "params": [index[id(p)] for p in group["params"]]}
                for saved, group in zip(saved_groups, groups, strict=True)
            ]
            zero.optimizer.load_state_dict({"state": filled, "param_groups": restored})
            # torch's load_state_dict builds new group dicts; keep the original ones, updated, since
            # ZeroOptimizer.param_groups (what Lightning and LR monitors read) wraps them.
            for original, loaded in zip(groups, zero.optimizer.param_groups, strict=True):
                original.update(loaded)
            zero.optimizer.param_groups = groups

        return load

    @staticmethod
    def _new_state(zero: ZeroOptimizer, master: Tensor, name: str) -> Tensor:
        """Where optimizer state ``name`` of ``master`` is loaded: created in its tier if the tiers keep it there
        (no memory: Note [checkpoints stream through the tiers]), else zeros in memory (zeros: a parameter absent
        from a full checkpoint had no state yet)."""
        tiered = zero.tiers.new_state(master, name) if zero.tiers is not None else None
        return tiered if tiered is not None else torch.zeros_like(master)

    def read_dcp(
        self,
        directory: Location,
        metadata: Metadata,
        process_group: dist.ProcessGroup | None,
        memory: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Fill every destination from the DCP files, or from ``memory`` (flattened) where its storage key is there."""
        memory = memory or {}
        files = {k: v for k, v in self.reads.items() if k not in memory}
        _dcp_read(files, directory, metadata, self.toc, process_group)
        self.read_from(memory, only=memory.keys())

    def read_from(self, sources: Mapping[str, Tensor | FlatSource], only: Collection[str] | None = None) -> None:
        """Fill every destination (``only`` those of these storage keys) from full in-memory, memory-mapped or lazily
        read ``sources`` (flattened), one parameter at a time."""
        with torch.no_grad():
            for key, destination in self.reads.items():
                if only is not None and key not in only:
                    continue
                source = sources[key]
                if isinstance(destination, FlatChunk):
                    piece = destination.destination(0, destination.numel)
                    piece.copy_(source[destination.offset : destination.offset + destination.numel])
                    destination.commit(0, piece)
                else:
                    assert isinstance(source, Tensor), "whole destinations are 0-d optimizer state, from memory"
                    destination.copy_(source)

    def finish(self, zero_optimizers: Sequence[ZeroOptimizer]) -> None:
        with torch.no_grad():
            for step in self.after:
                step()
        for zero in zero_optimizers:
            zero.gather_parameters()


def read_whole(
    directory: Location, metadata: Metadata, toc: Toc, keys: Mapping[str, str], process_group: dist.ProcessGroup | None
) -> dict[str, Tensor]:
    """{name: storage key} -> {name: the whole stored tensor}, read on every rank of ``process_group`` (None: by this
    rank alone), tied names sharing one tensor."""
    request = {}
    for storage in set(keys.values()):
        info = toc["tensors"][storage]
        stored = [math.prod(info["shape"])] if info["flat"] else info["shape"]  # flat: 1-D in the files
        request[storage] = torch.empty(stored, dtype=info_dtype(info))
    _dcp_read(dict(request), directory, metadata, toc, process_group)
    return {name: request[storage].view(toc["tensors"][storage]["shape"]) for name, storage in keys.items()}


def _dcp_read(
    request: dict[str, Any],
    directory: Location,
    metadata: Metadata,
    toc: Toc,
    process_group: dist.ProcessGroup | None,
) -> None:
    try:
        dcp_load(request, SafeReader(directory, metadata, toc["files"]), SafeLoadPlanner(), process_group)
    except CheckpointException as error:  # DCP gathers every rank's failure; ours already say what to do
        first = next(f[0] if isinstance(f, tuple) else f for f in error.failures.values())
        if isinstance(first, CheckpointError):
            raise first from error
        raise CheckpointError(f"Loading {directory} failed: {first}") from error


def _check_keys(model: str, expected: set[str], saved: set[str], strict: bool, origin: Location) -> None:
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{origin} does not match the {model}: {len(missing)} key(s) missing from the checkpoint "
            f"{missing[:5]}, {len(unexpected)} unexpected key(s) {unexpected[:5]}. HINT: load a checkpoint of this "
            "model, or set `strict_loading = False` on the LightningModule to load only the matching keys."
        )


def _hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
