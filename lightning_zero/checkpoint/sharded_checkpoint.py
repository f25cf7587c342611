"""Sharded checkpoints of a ZeRO model: each rank saves and loads only what it owns; any layout loads any other.

Everything hinges on one question, answered in one place (``slices.owned_parameter_slices``): which
elements of which parameter does this rank own, and where do their values, fp32 master and optimizer state live? A
rank's shard of a bucket is contiguous, so the answer is at most one range ``[start, stop)`` of each flattened
parameter.

Save (``save_sharded_checkpoint``, every rank): Lightning hands over its checkpoint dictionary whose ``state_dict``
is ``sharded_model_state()`` and whose ``optimizer_states`` are ``sharded_optimizer_state()``: this rank's ranges as
``FlatChunk``s (written once, by their owner) and replicated tensors (frozen parameters, buffers, 0-d optimizer state
such as Adam's ``step``; DCP writes each once). Rank 0 adds ``lightning_state.pt``: the rest of Lightning's state and
the table of contents, merged from every rank (``format``: the layout; ``files``: safe
reading and the atomic commit).

Note [replicated entries are rank 0's]
DCP's planner writes a tensor that several ranks hand it (a buffer, a frozen parameter, Adam's ``step``) once, from
whichever rank its deduplication picks to balance the files (rank 1 of 2, typically). Ranks' copies can differ:
BatchNorm statistics under ``broadcast_buffers=False``, or between DDP's broadcasts. DDP's checkpoint holds rank 0's,
so every rank but 0 hands DCP only its ranges and its optimizer state (whose 0-d entries, such as ``step``, every rank
holding a range of that parameter has alike), and every entry of the model's state dict or of a ``WeightAveraging``
average that is not sharded is written by rank 0.

Load (``load_checkpoint``, every rank): for every range this rank owns *now*, ask for the same range of the saved
flattened tensor; DCP reads the overlapping pieces of whichever chunks were saved, so the world size, the stage and
the bucket sizes may all differ from the saving run. Masters are filled first (the exact fp32 values), parameter
shards follow from them, and ``gather_parameters()`` rebuilds full parameters. A single ``.ckpt`` file (a DDP run's
full checkpoint) goes through the same plan with in-memory sources instead of DCP (``full``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from lightning_zero.checkpoint.files import (
    CheckpointError,
    abandon_save,
    commit_save,
    load_lightning_state,
    refuse_replacing_other_files,
    refuse_unloadable_state,
    stage_save,
)
from lightning_zero.checkpoint.format import (
    TOC_KEY,
    FlatChunk,
    SavePlanner,
    Toc,
    averaged_key,
    build_toc,
    merge_tocs,
    model_key,
    open_committed,
)
from lightning_zero.checkpoint.frozen import FROZEN_KEY, frozen_keys, frozen_source
from lightning_zero.checkpoint.full import full_checkpoint_sources
from lightning_zero.checkpoint.full_weights import load_pretrained, refresh_gathered
from lightning_zero.checkpoint.local_commit import recover_interrupted_commit
from lightning_zero.checkpoint.pretrained import is_pretrained_source
from lightning_zero.checkpoint.sections import Section, section_state, section_toc
from lightning_zero.checkpoint.slices import LoadPlan, owned_parameter_slices, read_whole
from lightning_zero.checkpoint.storage import ChecksummingWriter, Location, WriteFiles, locate
from lightning_zero.checkpoint.tiered import Span, TierStorage, chunk_of
from lightning_zero.sharding.sharded_optimizer import ShardedParameters, ZeroOptimizer

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "owned_parameter_slices",
    "save_sharded_checkpoint",
    "sharded_model_state",
    "sharded_optimizer_state",
]


# -- save ------------------------------------------------------------------------------------------------------------
def sharded_model_state(
    module: nn.Module,
    zero_optimizers: Sequence[ZeroOptimizer],
    gatherer: ShardedParameters | None = None,
    tiers: TierStorage | None = None,
    exclude_frozen: bool = False,
) -> dict[str, FlatChunk | Tensor]:
    """``module.state_dict()`` as this rank saves it: owned ranges of sharded parameters, replicated tensors whole.

    Tied names map to the same object, so the tensor is stored once. Nothing is copied, and nothing is read from
    the memory ``tiers`` until the save writes it (Note [checkpoints stream through the tiers]). ``exclude_frozen``
    leaves out parameters that do not require grad (Note [frozen base restored from its source] in ``frozen.py``).
    """
    excluded = set(frozen_keys(module)) if exclude_frozen else set()
    by_param = {id(s.param): s for s in owned_parameter_slices(zero_optimizers, gatherer)}
    made: dict[int, FlatChunk | Tensor] = {}
    state: dict[str, FlatChunk | Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in excluded:
            continue
        if not isinstance(value, Tensor):
            raise CheckpointError(
                f"State dict entry {key!r} of {type(module).__name__} is a {type(value).__name__}; sharded "
                "checkpoints hold tensors only. HINT: keep extra state in `on_save_checkpoint` instead."
            )
        if id(value) not in made:
            s = by_param.get(id(value))
            made[id(value)] = value.detach() if s is None else chunk_of(s.values_span, s.start, s.shape, tiers)
        state[key] = made[id(value)]
    return state


def sharded_optimizer_state(
    zero_optimizers: Sequence[ZeroOptimizer], index: int, tiers: TierStorage | None = None
) -> dict[str, Any]:
    """Optimizer ``index``'s state for this rank's ranges, keyed by parameter FQN, plus separate fp32 masters (read
    from the memory ``tiers`` only when the save writes them)."""
    zero = zero_optimizers[index]
    state: dict[str, dict[str, FlatChunk | Tensor]] = {}
    masters: dict[str, FlatChunk] = {}
    for s in owned_parameter_slices(zero_optimizers):
        master = s.master_span
        if s.optimizer != index or master is None or s.state_key is None:
            continue
        if s.own_master:
            masters[s.fqn] = chunk_of(master, s.start, s.shape, tiers)
        entries: dict[str, FlatChunk | Tensor] = {}
        for name, value in zero.state.get(s.state_key, {}).items():
            if isinstance(value, Tensor) and value.shape == s.state_key.shape:  # element-wise, like the master
                span = Span(value, s.state_offset, s.stop - s.start)
                entries[name] = chunk_of(span, s.start, s.shape, tiers)
            elif isinstance(value, Tensor) and value.dim() == 0:  # e.g. Adam's step: one value for the whole run
                entries[name] = value
            else:
                raise CheckpointError(
                    f"Cannot checkpoint {type(zero.optimizer).__name__} state {name!r} of parameter {s.fqn!r}: a "
                    f"{type(value).__name__} {getattr(value, 'shape', '')}, neither element-wise nor a 0-d tensor. "
                    "HINT: ZeRO checkpoints support element-wise optimizers whose state is tensors."
                )
        if entries:
            state[s.fqn] = entries
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in zero.optimizer.param_groups]
    return {"state": state, "masters": masters, "param_groups": groups}


def save_sharded_checkpoint(
    checkpoint: dict[str, Any],
    path: str | PathLike[str],
    process_group: dist.ProcessGroup | None,
    saved_with: Mapping[str, int],
    averaged: Mapping[str, Tensor] | None = None,
    masters_of: Mapping[str, str] | None = None,
) -> None:
    """Write ``checkpoint`` (with sharded ``state_dict`` / ``optimizer_states``) as the directory ``path``, a local
    path or an fsspec URL. ``averaged``: a full averaged copy of the model's state dict, the same on every rank (a
    ``WeightAveraging`` callback's), stored whole once and given back by ``load_checkpoint`` as ``state_dict``.
    ``masters_of``: which ``state_dict`` keys take their exact values from which parameter's fp32 master (Note
    [checkpoint hooks see the model's values] in ``model_entries.py``); None: each parameter's own key.

    Collective: every rank of ``process_group`` calls it with the same path. See Note [atomic commit] (local) and
    Note [commit on an object store] (remote URLs).
    """
    target = locate(path)
    refuse_replacing_other_files(target, process_group)  # Note [what a save may replace]
    rank = 0 if process_group is None else process_group.rank()
    tensors, toc = prepare_save(checkpoint, rank, averaged, masters_of)
    refuse_unloadable_state(checkpoint, target, process_group)  # Note [a save that cannot load back]
    write_save(checkpoint, tensors, toc, path, process_group, saved_with)


def prepare_save(
    checkpoint: dict[str, Any],
    rank: int,
    averaged: Mapping[str, Tensor] | None = None,
    masters_of: Mapping[str, str] | None = None,
) -> tuple[dict[str, FlatChunk | Tensor], Toc]:
    """What this rank writes of ``checkpoint`` (the chunks and tensors DCP saves, views of the live state) and its part
    of the table of contents; the sharded entries leave ``checkpoint``, which keeps Lightning's other state."""
    optimizer_states = checkpoint.pop("optimizer_states", None)
    tensors, toc = build_toc(checkpoint.pop("state_dict", {}), optimizer_states or [], averaged, masters_of)
    if rank != 0:  # Note [replicated entries are rank 0's]
        every_rank = (model_key(""), averaged_key(""))
        tensors = {k: v for k, v in tensors.items() if isinstance(v, FlatChunk) or not k.startswith(every_rank)}
    if optimizer_states is not None:  # Lightning checks it is there; the tensors themselves live in DCP
        checkpoint["optimizer_states"] = [{"param_groups": s["param_groups"]} for s in optimizer_states]
    return tensors, toc


def write_save(
    checkpoint: dict[str, Any],
    tensors: dict[str, FlatChunk | Tensor],
    toc: Toc,
    path: str | PathLike[str],
    process_group: dist.ProcessGroup | None,
    saved_with: Mapping[str, int],
    write_files: WriteFiles | None = None,
) -> None:
    """Write what ``prepare_save`` gave and commit the checkpoint (Note [atomic commit], Note [commit on an object
    store]). Collective over ``process_group``. ``write_files``: who writes the local files (Note [writer process]
    in ``async_save.py``); None: this thread."""
    target = locate(path)
    rank = 0 if process_group is None else process_group.rank()
    staged: list[Location | None] = [stage_save(target) if rank == 0 else None]
    if process_group is not None:
        dist.broadcast_object_list(staged, src=dist.get_global_rank(process_group, 0), group=process_group)
    directory = staged[0]
    assert directory is not None, "rank 0 chose the directory"
    try:
        writer = ChecksummingWriter(directory, None if target.remote else write_files)
        try:
            dcp_save(tensors, storage_writer=writer, planner=SavePlanner(), process_group=process_group)
        except CheckpointException as error:  # DCP gathers every rank's failure: name the first and the checkpoint
            first = next(f[0] if isinstance(f, tuple) else f for f in error.failures.values())
            raise CheckpointError(
                f"Saving checkpoint {target} failed: {type(first).__name__}: {first}. Nothing was committed; a "
                "previous checkpoint of that name is intact. HINT: check that the location is writable and has room."
            ) from error
        toc["files"] = writer.shard_checksums()
        world = 1 if process_group is None else process_group.size()
        tocs: list[Toc | None] = [None] * world
        if process_group is None:
            tocs[0] = toc
        else:
            dst = dist.get_global_rank(process_group, 0)
            dist.gather_object(toc, tocs if rank == 0 else None, dst=dst, group=process_group)
        if rank == 0:
            merged = merge_tocs([t for t in tocs if t is not None], saved_with)
            if target.remote:
                merged["data"] = directory.name
            commit_save({**checkpoint, TOC_KEY: merged}, directory, target)
    except BaseException:
        if rank == 0:
            abandon_save(directory, target)
        raise
    if process_group is not None:  # nobody returns before the checkpoint exists under its final name
        dist.barrier(group=process_group)


# -- load ------------------------------------------------------------------------------------------------------------
def load_checkpoint(
    path: str | PathLike[str],
    module: nn.Module,
    zero_optimizers: Sequence[ZeroOptimizer],
    process_group: dist.ProcessGroup | None,
    *,
    load_optimizer: bool,
    strict: bool = True,
    gatherer: ShardedParameters | None = None,
    tiers: TierStorage | None = None,
    built_on_meta: bool = False,
    section: Section | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint directory (any world size, stage or bucket size) or a full ``.ckpt`` file.

    Collective. Weights, masters and (``load_optimizer``) optimizer state land directly in this rank's shards, or
    in their memory ``tiers`` (Note [checkpoints stream through the tiers]);
    returns the rest of Lightning's state (loops, callbacks, LR schedulers, param-group hyper-parameters, ...), and as
    ``state_dict`` the full averaged copy of the model if the save had one (``save_sharded_checkpoint(averaged=)``).
    A checkpoint that left the frozen parameters out restores them from the source it records first (Note [frozen
    base restored from its source]); ``built_on_meta``: this run's model was built on meta and only initialized.
    ``section``: what ``module`` and each of ``zero_optimizers`` load of a checkpoint holding several models (Note
    [several models in one checkpoint] in ``sections.py``); it replaces ``load_optimizer``.
    """
    checkpoint = ready_to_read(path, process_group)
    if is_pretrained_source(checkpoint):  # weights only, e.g. `fit(ckpt_path=hf_dir)`: Lightning restores nothing else
        load_pretrained(module, path, zero_optimizers, gatherer, prefix=None, strict=strict, tiers=tiers)
        return {}
    if section is not None:
        load_optimizer = any(i is not None for i in section.optimizers)
        strict = strict and section.model
    if checkpoint.isfile():  # e.g. a DDP run's checkpoint: full tensors, sliced here
        state = load_lightning_state(checkpoint, mmap=True)
        if section is not None:
            section_state(state, section)
        load_full_checkpoint(
            state,
            checkpoint,
            module,
            zero_optimizers,
            load_optimizer=load_optimizer,
            strict=strict,
            gatherer=gatherer,
            tiers=tiers,
            built_on_meta=built_on_meta,
        )
        return state
    slices = owned_parameter_slices(zero_optimizers, gatherer)
    state, toc, data, metadata = open_committed(checkpoint)
    if section is not None:
        section_state(state, section)
        toc = section_toc(toc, section)
    excluded = restore_frozen(state, module, checkpoint, zero_optimizers, gatherer, tiers, built_on_meta)
    plan = LoadPlan(module, slices, toc, strict=strict, origin=checkpoint, tiers=tiers, excluded=excluded)
    if load_optimizer and toc["optimizers"]:
        plan.add_optimizers(zero_optimizers, state.get("optimizer_states"))
    plan.read_dcp(data, metadata, process_group)
    plan.finish(zero_optimizers)
    refresh_gathered(gatherer)
    if toc.get("averaged"):
        state["state_dict"] = read_whole(data, metadata, toc, toc["averaged"], process_group)
    return state


def ready_to_read(path: str | PathLike[str], process_group: dist.ProcessGroup | None) -> Location:
    """``path`` located, a commit a crash interrupted finished first (Note [atomic commit]); collective."""
    checkpoint = locate(path)
    if not checkpoint.remote and (process_group is None or process_group.rank() == 0):
        recover_interrupted_commit(checkpoint.local)  # Note [atomic commit]
    if process_group is not None:
        dist.barrier(group=process_group)
    checkpoint.forget_listings()
    return checkpoint


def load_full_checkpoint(
    state: dict[str, Any],
    origin: Location,
    module: nn.Module,
    zero_optimizers: Sequence[ZeroOptimizer],
    *,
    load_optimizer: bool,
    strict: bool,
    gatherer: ShardedParameters | None,
    tiers: TierStorage | None,
    built_on_meta: bool,
) -> None:
    """Load a full Lightning checkpoint read from ``origin`` (``state_dict``, ``optimizer_states`` in torch's format:
    a DDP run's, or a one-file Fabric checkpoint arranged so) into this rank's shards; collective. ``state`` keeps
    the rest, as ``load_checkpoint`` returns it."""
    excluded = restore_frozen(state, module, origin, zero_optimizers, gatherer, tiers, built_on_meta)
    sources, toc = full_checkpoint_sources(state, module, zero_optimizers if load_optimizer else (), origin)
    slices = owned_parameter_slices(zero_optimizers, gatherer)
    plan = LoadPlan(module, slices, toc, strict=strict, origin=origin, tiers=tiers, excluded=excluded)
    if load_optimizer and toc["optimizers"]:
        plan.add_optimizers(zero_optimizers, state.get("optimizer_states"))
    plan.read_from(sources)
    plan.finish(zero_optimizers)
    refresh_gathered(gatherer)


def restore_frozen(
    state: Mapping[str, Any],
    module: nn.Module,
    origin: Location,
    zero_optimizers: Sequence[ZeroOptimizer],
    gatherer: ShardedParameters | None,
    tiers: TierStorage | None,
    built_on_meta: bool,
) -> list[str]:
    """Load the frozen base a checkpoint left out from its recorded source; the keys it left out."""
    if FROZEN_KEY not in state:
        return []
    excluded, source = frozen_source(state[FROZEN_KEY], origin, built_on_meta=built_on_meta)
    if source is not None:  # every entry it holds; the checkpoint's own entries are loaded over it
        load_pretrained(module, source, zero_optimizers, gatherer, prefix=None, strict=False, tiers=tiers)
    return excluded
