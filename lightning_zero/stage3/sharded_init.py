"""Stage-3 sharding of a model, unit by unit, so that no rank ever holds the whole model.

``shard_module`` accepts a model built normally or on the ``meta`` device (``LightningModule.configure_model`` and
``trainer.init_module(empty_init=True)`` under ``ZeroStrategy(stage=3)`` build on meta). It walks the modules in
registration pre-order; a parameter still on meta is allocated on the target device and initialized by its module's
``reset_parameters()``; as soon as the walk leaves a unit's subtree, the unit is broadcast from rank 0 (so ranks
seeded differently agree, as DDP guarantees), sharded, and its full parameters are freed. Peak memory is therefore
one unit plus the root unit, not the model.

Note [initialization order]
Calling ``reset_parameters()`` in registration pre-order is what constructing the layers in that order does, so a
model whose layers initialize themselves (every ``torch.nn`` layer, and the models in ``lightning_zero.models``)
gets bit-identical initial weights from the same seed. A parameter shared by several modules (tied embeddings) is
re-initialized by each of them, consuming the same random numbers as separate construction would, and keeps the value
its first module gave it, as tying after construction does.

Note [meta buffers]
A buffer built on meta has no values: what ``__init__`` computed (RoPE's ``inv_freq``, a causal mask, a sinusoidal
table) is gone, and only the module's initializer can restore it. It is allocated (in its own dtype, on the target
device) before the initializer runs, and afterwards it must have been written, in place or by assigning a new
tensor; otherwise sharding stops with an error naming the module and the buffer, instead of training with zeros.
A module that owns only buffers is initialized the same way. Parameters are allocated filled with NaN, and one
the initializer left with any NaN stops sharding too: an initializer that forgets a parameter would otherwise train
from whatever the allocator returned.

Note [partly meta models]
A ``LightningModule`` that builds its network on meta in ``configure_model`` often registers small tensors of its own
in ``__init__`` (a step counter buffer, a temperature parameter) on the CPU, and a model built normally (on the CPU,
``from_pretrained``) has everything there. DDP moves the whole module to the device; FSDP2's ``fully_shard`` moves
what is materialized, and FSDP and DeepSpeed move or partition a model unit by unit, so that a model larger than one
device still shards. Sharding therefore never moves a whole model: it first moves every buffer and other
non-parameter tensor (a metric's states) that is neither on meta nor on the target device there, and each unit's
parameters only when that unit is sharded, so the device holds the shards so far and one unit, as for a model built
on meta. Parameter objects are kept.

Modules whose library initializes them beyond their ``reset_parameters()`` (Hugging Face models, peft adapters,
torch's ``nn.MultiheadAttention`` and ``nn.Transformer``) are initialized as their library would: see
``stage3/library_init.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import ProcessGroup
from lightning_zero.comm.streams import CollectiveStream
from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer
from lightning_zero.stage3.library_init import (
    LibraryInits,
    ParamInitFn,
    constructor_init,
    hugging_face_init,
    library_inits,
    lora_init,
    owns_meta_tensors,
)
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.sharded_unit import ShardedUnit
from lightning_zero.stage3.wrap_policy import assign_parameters, find_unit_roots
from lightning_zero.stage3.zeropp import install_zeropp


class UnitTiers(Protocol):
    """The memory tiers as stage-3 sharding sees them (``lightning_zero.offload``): each unit is handed over as soon
    as it is sharded, so its shards go straight to their tier, and they build the gradient reducer."""

    def attach(self, unit: ShardedUnit) -> None: ...

    def reducer_factory(self, *args: Any, **kwargs: Any) -> ShardedGradReducer: ...


def _default_init(module: nn.Module) -> None:
    reset = constructor_init(module)
    if reset is None:
        raise TypeError(
            f"Cannot initialize the parameters and buffers of {type(module).__name__} built on the meta device: it "
            "has no reset_parameters(). HINT: give the module a reset_parameters() that initializes its own "
            "parameters and buffers, or pass `param_init_fn` to ZeroStrategy (ZeroFabricStrategy), or build the "
            "model outside `configure_model`, `trainer.init_module(empty_init=True)` and "
            "`fabric.init_module(empty_init=True)`."
        )
    reset()


@contextmanager
def _weak_references_released(module: nn.Module) -> Iterator[None]:
    """Torch's recurrent layers keep weak references to their parameters (``_flat_weight_refs``, for cuDNN's flat
    weights), which ``swap_tensors`` refuses; they are dropped for the swap and rebuilt by the layer itself afterwards,
    as ``nn.RNNBase._apply`` does after ``to()``."""
    if not isinstance(module, nn.RNNBase):
        yield
        return
    module._flat_weight_refs = []
    try:
        yield
    finally:
        module._init_flat_weights()


class _Fresh:
    """A module's parameters and buffers just allocated for initialization, and the tied parameters it shares with
    modules initialized before it (whose values it must keep)."""

    def __init__(self, module: nn.Module, device: torch.device, done: set[int]) -> None:
        direct = list(module.parameters(recurse=False))
        self.params = [p for p in direct if p.is_meta]
        self.kept = {id(p): p.detach().clone() for p in direct if id(p) in done}
        self.direct = direct
        with _weak_references_released(module):
            for p in self.params:
                # swap_tensors keeps the Parameter object: ties and references held elsewhere stay valid. NaN until
                # the initializer writes it (Note [meta buffers]).
                value = torch.empty_like(p, device=device)
                if value.is_floating_point() or value.is_complex():
                    value.fill_(float("nan"))
                if weakref.getweakrefs(p):
                    raise RuntimeError(
                        f"A parameter of {type(module).__name__} built on the meta device is weakly referenced by "
                        "something outside the module, so it cannot be materialized in place (torch.utils."
                        "swap_tensors), and replacing it would leave that reference on meta. HINT: build this "
                        "module in `__init__`, outside `configure_model` and `trainer.init_module(empty_init=True)`."
                    )
                torch.utils.swap_tensors(p, nn.Parameter(value, p.requires_grad))
        self.buffers: dict[str, torch.Tensor] = {}
        for key, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                self.buffers[key] = torch.zeros_like(buffer, device=device)
                setattr(module, key, self.buffers[key])


def move_materialized(root: nn.Module, device: torch.device) -> None:
    """Move every buffer (and tensor state a module moves in ``_apply``, such as a metric's) of ``root`` that is
    neither on meta nor on ``device`` to ``device``, as ``Module.to`` would; parameters move with their unit
    (``move_unit_parameters``): Note [partly meta models]."""
    params = {id(p) for p in root.parameters()}
    root._apply(lambda t: t if t.is_meta or t.device == device or id(t) in params else t.to(device))


def move_unit_parameters(named: list[tuple[str, nn.Parameter]], device: torch.device) -> None:
    """Move one unit's materialized parameters to ``device``, keeping the objects: Note [partly meta models]."""
    with torch.no_grad():
        for _, p in named:
            if not p.is_meta and p.device != device:
                p.data = p.data.to(device)


def _allocate(module: nn.Module, device: torch.device, was_meta: set[int], done: set[int]) -> _Fresh | None:
    """Allocate ``module``'s own meta parameters and buffers; None if it has nothing to initialize.

    ``was_meta``: parameters that were on meta when sharding began; a module owning any of them is initialized even
    if a tied parameter was allocated by an earlier module. ``done``: parameters initialized so far.
    """
    if not any(id(p) in was_meta for p in module.parameters(recurse=False)) and not any(
        b.is_meta for b in module.buffers(recurse=False)
    ):
        return None
    return _Fresh(module, device, done)


class _Member:
    """A module whose own parameters and buffers ``_allocate`` gave it, waiting for its initializer."""

    def __init__(self, module: nn.Module, fresh: _Fresh, name: str) -> None:
        self.module, self.fresh, self.name = module, fresh, name

    def check(self) -> None:
        """Raise, naming them, if the initializer left any of them unwritten (Note [meta buffers])."""
        module, fresh, name = self.module, self.fresh, self.name
        untouched = [k for k, b in fresh.buffers.items() if module._buffers.get(k) is b and b._version == 0]
        allocated = {id(p) for p in fresh.params}
        unset = [k for k, p in module.named_parameters(recurse=False) if id(p) in allocated and bool(p.isnan().any())]
        if not untouched and not unset:
            return
        kind = "Parameter(s)" if unset else "Buffer(s)"
        where = ", ".join(repr(f"{name}.{k}" if name else k) for k in unset or untouched)
        lost = "training would start from uninitialized memory"
        if not unset:
            lost = "what __init__ computed is lost, and training would use zeros"
        verb = "initialize" if unset else "compute"
        raise RuntimeError(
            f"{kind} {where} of {type(module).__name__} were built on the meta device and its initializer "
            f"(reset_parameters(), param_init_fn, or its library's own initialization) did not set them: {lost}. "
            f"HINT: {verb} them in {type(module).__name__}.reset_parameters() (e.g. "
            f"`self.{(unset or untouched)[0]}.copy_(...)`), or in `param_init_fn`, or build the model in `__init__` "
            "outside `configure_model` and `trainer.init_module(empty_init=True)`."
        )


def _initialize(members: list[_Member], init: Callable[[], None], done: set[int]) -> None:
    """Run the initializer of ``members`` (one module, or a LoRA layer's adapters) and check that it wrote all they
    were given; tied parameters keep the value of the module that initialized them first (Note [initialization
    order])."""
    with torch.no_grad():
        init()
        for member in members:
            for p in member.fresh.direct:
                if id(p) in member.fresh.kept:
                    p.copy_(member.fresh.kept[id(p)])
    for member in members:
        done.update(id(p) for p in member.fresh.direct)
    for member in members:
        member.check()


def unit_bucket_layout(
    named: list[tuple[str, nn.Parameter]], config: ZeroConfig
) -> list[tuple[bool, list[tuple[str, nn.Parameter]]]]:
    """How one unit's parameters are split into flat buckets: ``(resident, members)``, one per (resident, dtype,
    requires_grad). Pure (no process group, no memory), so ``cli/estimate`` lays out a meta model with it too."""
    kinds: dict[tuple[bool, torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
    # Matrices first, then vectors: a weight-decay/no-decay split then cuts each shard into few runs.
    for fqn, p in sorted(named, key=lambda item: item[1].dim() < 2):
        resident = p.numel() < config.persistence_threshold
        kinds.setdefault((resident, p.dtype, p.requires_grad), []).append((fqn, p))
    return [(resident, members) for (resident, _, _), members in kinds.items()]


def _unit_buckets(
    named: list[tuple[str, nn.Parameter]], config: ZeroConfig, group: ProcessGroup
) -> tuple[list[FlatBucket], list[FlatBucket]]:
    """(sharded, resident) buckets for one unit's parameters, laid out by ``unit_bucket_layout``."""
    rank, world = group.rank(), group.size()
    source = dist.get_global_rank(group, 0) if world > 1 else 0
    sharded: list[FlatBucket] = []
    resident_buckets: list[FlatBucket] = []
    for resident, members in unit_bucket_layout(named, config):
        bucket = FlatBucket(-1, -1, members, rank, world, resident=True)
        if world > 1:
            assert bucket.data is not None
            dist.broadcast(bucket.data, src=source, group=group)
        if not resident:
            bucket.make_sharded()
        (resident_buckets if resident else sharded).append(bucket)
    return sharded, resident_buckets


def shard_module(
    root: nn.Module,
    config: ZeroConfig,
    group: ProcessGroup,
    device: torch.device,
    param_init_fn: ParamInitFn | None = None,
    tiers: UnitTiers | None = None,
) -> ParameterGatherer:
    """Shard ``root`` for stage 3 (materializing it unit by unit if it is on meta) and install the gather hooks.

    ``tiers``: each unit's shards go to their memory tier as soon as the unit is sharded (``lightning_zero.offload``).
    """
    init = param_init_fn or _default_init
    move_materialized(root, device)  # Note [partly meta models]
    unit_roots = find_unit_roots(root, config)
    owned = assign_parameters(root, unit_roots)
    subtree_ids = [{id(m) for m in module.modules()} for _, module in unit_roots]
    modules = list(root.modules())
    last_position = [max(i for i, m in enumerate(modules) if id(m) in ids) for ids in subtree_ids]

    units: list[ShardedUnit | None] = [None] * (len(unit_roots) + 1)
    resident: list[FlatBucket] = []
    was_meta = {id(p) for p in root.parameters() if p.is_meta}
    done: set[int] = set()
    gather_stream = CollectiveStream(device)  # one all-gather stream for every unit, as FSDP2

    def build(index: int) -> None:
        name, module = ("", root) if index == 0 else unit_roots[index - 1]
        move_unit_parameters(owned[index], device)  # Note [partly meta models]
        sharded, kept = _unit_buckets(owned[index], config, group)
        units[index] = unit = ShardedUnit(index, name, module, sharded, gather_stream)
        resident.extend(kept)
        if tiers is not None:
            tiers.attach(unit)

    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    library = LibraryInits() if param_init_fn is not None else library_inits(root)  # raises before any collective
    position_of = {id(m): i for i, m in enumerate(modules)}
    on_meta = {id(m) for m in modules if owns_meta_tensors(m)}
    # Modules their library initializes after their children: at the position where the walk leaves their subtree,
    # deepest (latest start) first, which is post-order (Note [Hugging Face initialization] in library_init.py).
    ends: dict[int, list[int]] = {}
    for start, module in enumerate(modules):
        if library.initialized_after_children(module) and any(id(d) in on_meta for d in module.modules()):
            end = max(position_of[id(d)] for d in module.modules())
            ends.setdefault(end, []).insert(0, start)
    deferred: dict[int, _Member] = {}

    def finish(module: nn.Module) -> None:
        """Initialize ``module`` as its library would, now that the walk has left its subtree."""
        if id(module) in library.lora:  # Note [peft adapters on meta]
            adapters = [
                deferred.pop(position_of[id(m)])
                for m in module.modules()
                if position_of[id(m)] in deferred and library.adapters.get(id(m)) is module
            ]
            init_lora = lora_init(module, library.lora[id(module)], [member.module for member in adapters])
            _initialize(adapters, init_lora, done)
            return
        own = deferred.pop(position_of[id(module)], None)
        if id(module) in library.attention:  # Note [torch's composite modules]
            reset = constructor_init(module)
            if own is not None and reset is not None:
                _initialize([own], library.finishing(module, reset), done)
            return
        init_hf = partial(hugging_face_init(library.hugging_face[id(module)], constructed=own is not None), module)
        if own is not None:
            _initialize([own], library.finishing(module, init_hf), done)
        else:  # nothing of its own, but its initialization may set its children's (GPT-2's scaled c_proj)
            with torch.no_grad():
                init_hf()

    for position, module in enumerate(modules):
        fresh = _allocate(module, device, was_meta, done)
        if fresh is not None:
            member = _Member(module, fresh, names.get(id(module), ""))
            if library.deferred(module):
                deferred[position] = member
            else:
                _initialize([member], library.finishing(module, partial(init, module)), done)
        for start in ends.get(position, []):
            finish(modules[start])
        for i, last in enumerate(last_position):
            if last == position:
                build(i + 1)
    assert not deferred, "every deferred module is initialized when the walk leaves it"
    build(0)
    assert all(u is not None for u in units)
    built = [u for u in units if u is not None]
    factory = {} if tiers is None else {"reducer_factory": tiers.reducer_factory}
    gatherer = ParameterGatherer(root, built, resident, group, config, device, **factory)
    return install_zeropp(gatherer, config, group)  # Note [ZeRO++ on a node topology]
