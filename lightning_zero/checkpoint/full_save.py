"""A full checkpoint written straight from the shards: one Lightning ``.ckpt`` file as a DDP run's ``torch.save``
writes it, which plain ``torch.load(weights_only=True)`` and a DDP run read (``ZeroConfig.state_dict_type="full"``,
FSDP's ``state_dict_type="full"``).

Note [full checkpoint streamed]
A ``torch.save`` file is a zip archive: the pickled object, in which each tensor names a storage record, and then one
record per storage; loading needs nothing else. So rank 0 pickles Lightning's checkpoint dictionary first, with a
reference (a ``Record``, ``archive_records.py``) for each full parameter and element-wise optimizer state that no rank
holds whole (every rank makes the same references). Then, bucket by bucket and parameter by parameter, in the same order
on every rank, each rank stages its shard of the bucket (its parameter values or, where the run keeps them, its fp32
masters; then each optimizer state) and sends rank 0 the range it holds of each parameter; rank 0 puts the parameter
together, appends it as its record and lets it go. A rank holds one staged shard of a bucket beyond its own state, and
rank 0 one parameter more (a parameter lies inside a stage-3 unit), never the model. Tensors every rank holds (buffers,
frozen parameters at stages 1 and 2, 0-d optimizer state such as Adam's ``step``, Lightning's own) are written by rank 0
from memory. Low-precision floating tensors are written in fp32, as ``consolidate`` does (the fp32 masters' exact values
where the run keeps them). Rank 0 writes into a hidden sibling and commits it under the final name
(Note [atomic commit]); if writing fails there, rank 0 still takes part in every gather and every rank raises the error
at the end, so nothing hangs and nothing is committed.

Note [full checkpoint on NCCL]
Where a shard is staged and sent depends on what the group carries: NCCL has no host backend (a host tensor sent over
it fails at the first send), and gloo's point-to-point ops take host tensors only (its ``send`` of a CUDA tensor
aborts the rank: Note [native collectives] in ``comm/collectives.py``). So the staged shard and rank 0's assembled
parameter live on the device of the bucket unless the group is gloo for that device, and rank 0 copies each
assembled parameter to the host just before appending it. On NCCL a rank thus holds one staged bucket shard on its
device (rank 0 one parameter more), as FSDP's full state dict gathers on the device; the object collectives
(``all_gather_object``, ``broadcast_object_list``) go through the device as torch does for NCCL. Creating a gloo side
group at setup would have avoided device memory, at the cost of a second communicator on every rank for the life
of the job and the host network for every byte of the model.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from os import PathLike
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.checkpoint.archive_records import ArchiveRecords, DeferredTensor, RecordPickler, written_dtype
from lightning_zero.checkpoint.files import CheckpointError, refuse_replacing_other_files, refuse_unloadable_state
from lightning_zero.checkpoint.format import FlatChunk
from lightning_zero.checkpoint.local_commit import commit, partial_sibling, remove_stale_siblings
from lightning_zero.checkpoint.slices import OwnedSlice, owned_parameter_slices
from lightning_zero.checkpoint.storage import locate
from lightning_zero.checkpoint.tiered import Span, TierStorage
from lightning_zero.compat import open_torch_save_archive
from lightning_zero.sharding.activation_checkpointing import parameter_names
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_optimizer import ShardedParameters, ZeroOptimizer


def _param_key(param: Tensor) -> Hashable:
    return ("param", id(param))


def _state_key(optimizer: int, param: Tensor, name: str) -> Hashable:
    return ("state", optimizer, id(param), name)


def save_full_checkpoint(
    checkpoint: dict[str, Any],
    path: str | PathLike[str],
    module: nn.Module,
    zero_optimizers: Sequence[ZeroOptimizer],
    process_group: dist.ProcessGroup | None,
    gatherer: ShardedParameters | None = None,
    tiers: TierStorage | None = None,
    arrange: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    param_of: Mapping[int, Tensor] | None = None,
    as_left: Collection[int] = (),
) -> None:
    """Write ``checkpoint`` (Lightning's dictionary, its ``state_dict`` this rank's ``sharded_model_state``) as one
    full ``torch.save`` file at the local ``path``, with the optimizers' full state in DDP's format if it has
    ``optimizer_states``. ``arrange`` lays the full dictionary out as the file holds it (a Fabric checkpoint's: the
    model and optimizers under their names). ``param_of``: the parameter each ``FlatChunk`` of the state dict is a
    range of, by ``id`` (default: the module's tensor of its key); ``as_left``: the ``id`` of the tensors written in
    their own dtype, not widened. Collective; rank 0 writes (Note [full checkpoint streamed])."""
    target = locate(path)
    if target.remote:
        raise CheckpointError(
            f"ZeroConfig.state_dict_type='full' writes local files; {target} is remote. HINT: use "
            "state_dict_type='sharded' (the default) for remote storage and `python -m lightning_zero consolidate` "
            "for one file."
        )
    refuse_replacing_other_files(target, process_group)  # Note [what a save may replace]
    refuse_unloadable_state(_lightning_state(checkpoint), target, process_group)  # Note [a save that cannot load back]
    rank = 0 if process_group is None else process_group.rank()
    slices = owned_parameter_slices(zero_optimizers, gatherer)
    by_param = {id(s.param): s for s in slices}
    records = ArchiveRecords(as_left)
    entries = module.state_dict(keep_vars=True)
    for name in ("state_dict", "current_model_state"):  # the latter: Note [Lightning's WeightAveraging]
        state = checkpoint.get(name)
        if isinstance(state, Mapping):
            params = {
                key: entries[key] if param_of is None else param_of[id(value)]
                for key, value in state.items()
                if isinstance(value, FlatChunk)
            }
            checkpoint[name] = {
                key: _deferred_parameter(records, params[key], by_param[id(params[key])]) if key in params else value
                for key, value in state.items()
            }
    flat: dict[tuple[int, str], torch.dtype] = {}
    if checkpoint.get("optimizer_states") is not None:
        flat, scalars = _state_layout(zero_optimizers, slices, process_group)
        checkpoint["optimizer_states"] = _torch_optimizer_states(
            module, zero_optimizers, checkpoint["optimizer_states"], flat, scalars, by_param, records
        )
    if arrange is not None:
        checkpoint = arrange(checkpoint)
    error: str | None = None
    writer: Any = None
    staged = partial_sibling(target.local)
    if rank == 0:
        try:
            target.local.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_siblings(target.local)
            stream = io.BytesIO()
            RecordPickler(stream, records).dump(checkpoint)
            writer = open_torch_save_archive(str(staged), stream.getvalue())
        except Exception as failure:  # still take part in every gather below: the other ranks wait in them
            error = f"{type(failure).__name__}: {failure}"
    for bucket in _buckets(zero_optimizers, gatherer):
        held = {id(param) for _, param in bucket.slots_and_params()}
        mine = [s for s in slices if id(s.param) in held and s.stop > s.start]
        values = [(s, s.master_span if s.own_master else s.values_span) for s in mine]
        dtype = written_dtype(bucket.param_shard.dtype)
        device = staging_device(bucket.device, process_group)  # Note [full checkpoint on NCCL]
        error = _stream(
            bucket, _staged(bucket, values, tiers, dtype, device), _param_key, records, writer, error, process_group
        )
        for (i, name), dtype in sorted(flat.items(), key=lambda item: item[0]):
            spans = [(s, _state_span(zero_optimizers[i], s, name)) for s in mine if s.optimizer == i]
            state = _staged(bucket, spans, tiers, dtype, device)
            error = _stream(
                bucket, state, lambda p, i=i, n=name: _state_key(i, p, n), records, writer, error, process_group
            )
    if rank == 0 and writer is not None and error is None:
        try:
            for key, data in records.memory.items():
                writer.write_record(f"data/{key}", data.untyped_storage(), data.nbytes)
            missing = records.missing()
            assert not missing, f"records {missing[:5]} were never written"
            writer.write_end_of_file()
            writer = None
            with open(staged, "rb") as f:
                os.fsync(f.fileno())
            commit(staged, target.local)
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
    if rank == 0 and error is not None:
        staged.unlink(missing_ok=True)
    errors = [error]
    if process_group is not None:
        dist.broadcast_object_list(errors, src=dist.get_global_rank(process_group, 0), group=process_group)
    if errors[0] is not None:
        raise CheckpointError(
            f"Saving the full checkpoint {target} failed: {errors[0]}. Nothing was committed; a previous checkpoint "
            "of that name is intact. HINT: check that the location is writable and has room."
        )


_FROM_SHARDS = ("state_dict", "current_model_state", "optimizer_states")
"""The entries written from the shards (Note [full checkpoint streamed]): the rest is Lightning's own state."""


def _lightning_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What of ``checkpoint`` the file pickles as given (Note [a save that cannot load back]): everything but the
    entries written from the shards, and of the optimizers' state their ``param_groups``, as the sharded save keeps
    it."""
    state = {key: value for key, value in checkpoint.items() if key not in _FROM_SHARDS}
    optimizer_states = checkpoint.get("optimizer_states")
    if isinstance(optimizer_states, Sequence):
        state["optimizer_states"] = [
            {"param_groups": s.get("param_groups")} if isinstance(s, Mapping) else s for s in optimizer_states
        ]
    return state


def _deferred_parameter(records: ArchiveRecords, param: Tensor, owned: OwnedSlice) -> DeferredTensor:
    # The master's dtype where the run keeps fp32 masters; a frozen low-precision parameter is widened alike.
    return records.deferred(_param_key(param), owned.shape, written_dtype(owned.shard.dtype))


def _state_span(zero: ZeroOptimizer, s: OwnedSlice, name: str) -> Span | None:
    value = zero.state.get(s.state_key, {}).get(name) if s.state_key is not None else None
    return None if value is None else Span(value, s.state_offset, s.stop - s.start)


def _state_layout(
    zero_optimizers: Sequence[ZeroOptimizer], slices: list[OwnedSlice], process_group: dist.ProcessGroup | None
) -> tuple[dict[tuple[int, str], torch.dtype], dict[tuple[int, str], dict[str, Tensor | None]]]:
    """Over every rank: each optimizer's element-wise state names and dtypes ``{(optimizer, name): dtype}``, and
    which parameter has which state ``{(optimizer, fqn): {name: 0-d value or None (element-wise)}}``."""
    mine: dict[tuple[int, str], dict[str, Tensor | torch.dtype]] = {}  # element-wise: its dtype; 0-d: its value
    for s in slices:
        if s.optimizer is None or s.state_key is None or s.stop <= s.start:
            continue
        for name, value in zero_optimizers[s.optimizer].state.get(s.state_key, {}).items():
            if isinstance(value, Tensor) and value.shape == s.state_key.shape:
                mine.setdefault((s.optimizer, s.fqn), {})[name] = value.dtype
            elif isinstance(value, Tensor) and value.dim() == 0:
                mine.setdefault((s.optimizer, s.fqn), {})[name] = value.detach().cpu()
            else:
                raise CheckpointError(
                    f"Cannot write optimizer state {name!r} of parameter {s.fqn!r} into a full checkpoint: a "
                    f"{type(value).__name__}, neither element-wise nor a 0-d tensor. HINT: ZeRO checkpoints support "
                    "element-wise optimizers whose state is tensors."
                )
    every: list[Any] = [mine]
    if process_group is not None:
        every = [None] * process_group.size()
        dist.all_gather_object(every, mine, group=process_group)
    flat: dict[tuple[int, str], torch.dtype] = {}
    which: dict[tuple[int, str], dict[str, Tensor | None]] = {}
    for layout in every:
        for (i, fqn), names in layout.items():
            for name, value in names.items():
                if isinstance(value, torch.dtype):
                    flat[(i, name)] = value
                which.setdefault((i, fqn), {}).setdefault(name, None if isinstance(value, torch.dtype) else value)
    return flat, which


def _torch_optimizer_states(
    module: nn.Module,
    zero_optimizers: Sequence[ZeroOptimizer],
    sharded: list[dict[str, Any] | None],
    flat: Mapping[tuple[int, str], torch.dtype],
    which: Mapping[tuple[int, str], Mapping[str, Tensor | None]],
    by_param: Mapping[int, OwnedSlice],
    records: ArchiveRecords,
) -> list[dict[str, Any] | None]:
    """Each optimizer's ``state_dict()`` as torch builds it under DDP: state by position in its param groups (None
    for an optimizer whose state the checkpoint leaves out)."""
    names = parameter_names(module)  # as the slices name them: Note [checkpoint wrappers keep the names]
    states: list[dict[str, Any] | None] = []
    for i, (zero, saved) in enumerate(zip(zero_optimizers, sharded, strict=True)):
        if saved is None:  # not saved: its state is left out of the file
            states.append(None)
            continue
        state: dict[int, dict[str, Any]] = {}
        groups = []
        position = 0
        for group, hyper in zip(zero.param_groups, saved["param_groups"], strict=True):
            positions = []
            for param in group["params"]:
                shape = by_param[id(param)].shape if id(param) in by_param else param.shape
                entry: dict[str, Any] = {}
                for name, value in which.get((i, names[id(param)]), {}).items():
                    if value is None:
                        entry[name] = records.deferred(_state_key(i, param, name), shape, flat[(i, name)])
                    else:
                        entry[name] = value
                if entry:
                    state[position] = entry
                positions.append(position)
                position += 1
            groups.append({**hyper, "params": positions})
        states.append({"state": state, "param_groups": groups})
    return states


def _buckets(zero_optimizers: Sequence[ZeroOptimizer], gatherer: ShardedParameters | None) -> list[FlatBucket]:
    held = gatherer.all_buckets() if gatherer is not None else [b for z in zero_optimizers for b in z.buckets]
    return list({id(b): b for b in held}.values())  # the same order on every rank


def staging_device(device: torch.device, process_group: dist.ProcessGroup | None) -> torch.device:
    """Where a bucket on ``device`` is staged and sent over ``process_group`` (Note [full checkpoint on NCCL])."""
    if process_group is None or device.type == "cpu":
        return torch.device("cpu")
    return torch.device("cpu") if backend_for(device, process_group) == "gloo" else device


def backend_for(device: torch.device, process_group: dist.ProcessGroup) -> str:
    """The backend ``process_group`` runs ``device``'s tensors on: ``"nccl"``, ``"gloo"``, or one of a per-device
    mapping such as ``"cpu:gloo,cuda:nccl"``."""
    backend = str(dist.get_backend(process_group))
    if ":" not in backend:
        return backend
    per_device = dict(entry.split(":", 1) for entry in backend.split(","))
    return per_device.get(device.type, "")


def _staged(
    bucket: FlatBucket,
    spans: list[tuple[OwnedSlice, Span | None]],
    tiers: TierStorage | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """This rank's shard of the bucket as written, on ``device``: the given span of each of its slices (zeros
    elsewhere)."""
    local = torch.zeros(bucket.shard_numel, dtype=dtype, device=device)
    for s, span in spans:
        if span is not None:
            local[s.shard_offset : s.shard_offset + span.numel] = span.read(tiers)
    return local


def _stream(
    bucket: FlatBucket,
    local: Tensor,
    what: Any,
    records: ArchiveRecords,
    writer: Any,
    error: str | None,
    process_group: dist.ProcessGroup | None,
) -> str | None:
    """Each parameter of the bucket that the file holds, put together on rank 0 from every rank's ``local`` shard
    (its own range sent by each rank that holds one) and appended as its record; one parameter at a time."""
    rank = 0 if process_group is None else process_group.rank()
    world = 1 if process_group is None else process_group.size()
    for slot, param in bucket.slots_and_params():
        record = records.known.get(what(param))
        if record is None:  # the same on every rank: records are made alike everywhere before the pickle
            continue
        out = torch.empty(slot.numel, dtype=local.dtype, device=local.device) if rank == 0 else None
        for r in range(world):  # rank r's part of the bucket is [r * shard_numel, (r + 1) * shard_numel)
            first = max(slot.offset, r * bucket.shard_numel)
            last = min(slot.offset + slot.numel, (r + 1) * bucket.shard_numel)
            if first >= last or (rank != 0 and rank != r):
                continue
            piece = local[first - r * bucket.shard_numel : last - r * bucket.shard_numel] if rank == r else None
            if out is None:
                assert process_group is not None, "only rank 0 assembles"
                assert piece is not None, "a rank sends its own range"
                dist.send(piece.contiguous(), dist.get_global_rank(process_group, 0), group=process_group)
            elif piece is not None:
                out[first - slot.offset : last - slot.offset] = piece
            else:
                assert process_group is not None, "another rank's range means a process group"
                view = out[first - slot.offset : last - slot.offset]
                dist.recv(view, dist.get_global_rank(process_group, r), group=process_group)
        if out is not None and writer is not None and error is None:
            try:
                data = out.to("cpu", record.dtype)  # the device's copy goes once it is on the host
                writer.write_record(f"data/{record.key}", data.untyped_storage(), data.nbytes)
                records.written.add(record.key)
            except Exception as failure:  # go on receiving: the other ranks are sending
                error = f"{type(failure).__name__}: {failure}"
    return error
