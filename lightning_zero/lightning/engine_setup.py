"""Setting the engine up for a front door: what ``ZeroStrategy`` (the Trainer's) and ``ZeroFabricStrategy``
(``lightning_zero.fabric``) both do to a model and its optimizers, written once.

- ``ranks_per_node``: the node size ZeRO++ and the metering by link need.
- ``shard_for_stage3``: stage 3's sharding of a model (built normally or on meta) unit by unit.
- ``wrap_optimizers``: the user's optimizers as ``ZeroOptimizer``s, one loss scaler each, with the tiers' space check
  and the communication ledger's topology.
- ``broadcast_buffers``: rank 0's buffers to every rank, in one coalesced broadcast as DDP's.
- ``install_module_state``: a stage-3 model's own ``state_dict``/``load_state_dict`` made true (Note [a stage-3
  model's state dict] in ``checkpoint/module_state.py``).
- ``serving``, ``calling``: the strategy collectives that serve a rank calling a model alone, and the calls that meet
  the other ranks first (Note [one-rank calls]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.module_state import ModuleState
from lightning_zero.checkpoint.tiered import TierStorage
from lightning_zero.comm.topology import ranks_per_node_from_environment
from lightning_zero.compat import broadcast_coalesced, get_default_store
from lightning_zero.config import ZeroConfig
from lightning_zero.lightning.grad_norm import refuse_released_placeholders
from lightning_zero.lightning.offload_setup import check_optimizer_space
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.activation_checkpointing import parameter_names
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.library_init import ParamInitFn
from lightning_zero.stage3.one_rank_calls import OneRankCalls
from lightning_zero.stage3.one_rank_calls import serving as serve_calls
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.sharded_init import shard_module
from lightning_zero.stage3.zeropp import metering_topology


def ranks_per_node(config: ZeroConfig, num_processes: int, world_size: int) -> int | None:
    """``ZeroConfig.ranks_per_node``, else the launcher's (Note [node topology] in ``comm/topology.py``), else
    Lightning's processes per node; None on a single node."""
    per_node = config.ranks_per_node or ranks_per_node_from_environment() or num_processes
    return per_node if 0 < per_node < world_size else None


def shard_for_stage3(
    module: nn.Module,
    config: ZeroConfig,
    group: dist.ProcessGroup,
    device: torch.device,
    num_processes: int,
    param_init_fn: ParamInitFn | None,
    tiers: MemoryTiers | None,
) -> ParameterGatherer:
    """Shard ``module`` for stage 3 unit by unit (``stage3/sharded_init.py``): one built on meta is materialized
    there, one built normally is moved to ``device`` a unit at a time (Note [partly meta models]), never whole.
    A model another strategy of this process sharded with the same config (an earlier ``Trainer``) keeps its shards:
    Note [a model sharded by an earlier Trainer]."""
    # ZeRO++ and the metering by link need the ranks per node; Lightning knows them when the environment does not.
    config = dataclasses.replace(config, ranks_per_node=ranks_per_node(config, num_processes, group.size()))
    earlier = getattr(module, _SHARDED_BY, None)
    if isinstance(earlier, ParameterGatherer):
        return adopt_sharded(earlier, module, config, group, tiers)
    refuse_released_placeholders(module)
    # Made before sharding's first broadcast, so every rank names the same instance (Note [one-rank calls]).
    # A model with nothing to train (a frozen teacher called in every training step) is not met in the store: its
    # forwards without gradients are collective, as a training step's are.
    trainable = any(p.requires_grad for p in module.parameters())
    several = group.size() > 1 and trainable
    calls = OneRankCalls(get_default_store(), group, config.collective_timeout_s) if several else None
    gatherer = shard_module(module, config, group, device, param_init_fn, tiers)
    if calls is not None:
        gatherer.attach_calls(calls)
    object.__setattr__(module, _SHARDED_BY, gatherer)
    return gatherer


_SHARDED_BY = "_lightning_zero_gatherer"
"""The attribute through which a later strategy finds the stage-3 sharding of a model (Note [a model sharded by an
earlier Trainer])."""


def adopt_sharded(
    gatherer: ParameterGatherer,
    module: nn.Module,
    config: ZeroConfig,
    group: dist.ProcessGroup,
    tiers: MemoryTiers | None,
) -> ParameterGatherer:
    """A model another strategy of this process sharded: take its sharding over, or refuse.

    Note [a model sharded by an earlier Trainer]
    Lightning's own strategy tests fit a model with one ``Trainer``, then validate and fit it again with a new one, as
    users do when they change a Trainer argument between phases. At stage 3 the first strategy left the model sharded
    (Note [teardown keeps the model sharded]): its parameters are placeholders and its shards live in that
    strategy's ``ParameterGatherer``, whose hooks are on the model. A later strategy of the same process, on the same
    process group and with the same ``ZeroConfig``, takes that sharding over as it is (as the same strategy does for
    ``fit``, ``validate``, ``fit``): new optimizers are built over the same shards, so the second fit continues from
    the weights the first one left, as under DDP. Anything else could not reuse the shards, and is refused: another
    config, group or tiers, and a ``requires_grad`` changed since (fine-tuning in phases): the buckets were laid out
    by it (frozen parameters get no gradient reduction), so the new phase would leave unfrozen weights where they
    are, silently."""
    buckets = [b for unit in gatherer.units for b in unit.buckets] + list(gatherer.resident_buckets)
    changed = {id(p) for b in buckets for p in b.params if p.requires_grad != b.trainable}
    if changed:
        name = next(n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in changed)
        raise ValueError(
            f"{type(module).__name__} was sharded for stage 3 by an earlier ZeroStrategy of this process, and "
            f"`requires_grad` of {name!r} (and {len(changed) - 1} more) changed since: its shards were laid out for "
            "the parameters trainable then, and cannot be taken over. HINT: build a fresh model for the new phase "
            "and load the weights into it: after the phase's fit, on every rank, `with "
            "trainer.strategy.full_state_dict(): weights = model.state_dict()`, then "
            "`new_model.load_state_dict(weights)` before the next Trainer."
        )
    previous = gatherer.config
    if previous != config or gatherer.group is not group or tiers is not None:
        raise ValueError(
            f"{type(module).__name__} was sharded for stage 3 by an earlier ZeroStrategy of this process, with "
            f"{_differences(previous, config)}{' and memory tiers' if tiers is not None else ''}: its shards can only "
            "be taken over by a strategy with the same ZeroConfig, on the same process group and without memory "
            "tiers. HINT: build the new Trainer's strategy with the same config, or build a fresh model and load the "
            "weights (`ckpt_path=`, `lightning_zero.load_full_state_dict`, or its `load_state_dict`)."
        )
    return gatherer


def _differences(previous: ZeroConfig, config: ZeroConfig) -> str:
    changed = [
        f"{f.name}={getattr(previous, f.name)!r} (now {getattr(config, f.name)!r})"
        for f in dataclasses.fields(config)
        if getattr(previous, f.name) != getattr(config, f.name)
    ]
    return "another config: " + ", ".join(changed) if changed else "the same config"


def install_module_state(
    module: nn.Module,
    gatherer: ParameterGatherer,
    optimizers: Callable[[], Sequence[ZeroOptimizer]],
    tiers: Callable[[], TierStorage | None],
) -> ModuleState:
    """Make a stage-3 model's ``state_dict()`` and ``load_state_dict()`` true (Note [a stage-3 model's state dict]
    in ``checkpoint/module_state.py``), once per model."""
    installed = getattr(module, _MODULE_STATE, None)
    if isinstance(installed, ModuleState) and installed.gatherer is gatherer:
        installed.bind(optimizers, tiers)
        return installed
    state = ModuleState(module, gatherer, optimizers, tiers)
    object.__setattr__(module, _MODULE_STATE, state)
    return state


_MODULE_STATE = "_lightning_zero_module_state"


def module_state_of(module: nn.Module) -> ModuleState | None:
    """The ``ModuleState`` ``install_module_state`` gave ``module``, if any."""
    installed = getattr(module, _MODULE_STATE, None)
    return installed if isinstance(installed, ModuleState) else None


@contextmanager
def serving(gatherers: Iterable[ParameterGatherer | None]) -> Iterator[None]:
    """Around a strategy collective every rank reaches (``barrier``, Fabric's ``all_reduce``...): first serve a rank
    that calls one of these stage-3 models alone (Note [one-rank calls] in ``stage3/one_rank_calls.py``)."""
    with serve_calls([g.calls for g in gatherers if g is not None and g.calls is not None]):
        yield


@contextmanager
def calling(gatherers: Iterable[ParameterGatherer | None], what: str) -> Iterator[None]:
    """A call outside a step (``gathered_parameters()``): meet the other ranks first (Note [one-rank calls])."""
    began: list[OneRankCalls] = []
    try:
        for gatherer in gatherers:
            if gatherer is not None and gatherer.calls is not None:
                gatherer.calls.begin(what)
                began.append(gatherer.calls)
        yield
    finally:
        for calls in began:
            calls.end()


def wrap_optimizers(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    group: dist.ProcessGroup,
    config: ZeroConfig,
    precision: ZeroPrecision,
    gatherer: ParameterGatherer | None,
    tiers: MemoryTiers | None,
    num_processes: int,
) -> list[ZeroOptimizer]:
    """Wrap each of the model's ``optimizers`` (all of them, every time: one loss scaler per optimizer, Note [one
    loss scale per optimizer] in ``sharding/loss_scaler.py``). An optimizer that is a ``ZeroOptimizer`` already is
    kept, with its scaler replaced by the one of its place."""
    if gatherer is None:
        refuse_parameters_in_two_optimizers(module, optimizers)
    scalers = precision.loss_scalers_for(len(optimizers))
    wrapped: list[ZeroOptimizer] = []
    fresh: list[ZeroOptimizer] = []
    for optimizer, scaler in zip(optimizers, scalers, strict=True):
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.loss_scaler = scaler
            wrapped.append(optimizer)
            continue
        zero = ZeroOptimizer(
            module,
            optimizer,
            group,
            config,
            gatherer,
            fp32_masters=precision.fp32_masters,
            loss_scaler=scaler,
            tiers=tiers.for_optimizer() if tiers is not None else None,
        )
        wrapped.append(zero)
        fresh.append(zero)
    if tiers is not None:
        check_optimizer_space(tiers, wrapped, num_processes)
    if gatherer is None:  # stage 3's ledger has its topology from shard_module
        per_node = ranks_per_node(config, num_processes, group.size())
        topology = metering_topology(dataclasses.replace(config, ranks_per_node=per_node), group)
        for zero in fresh:
            zero.ledger.topology = topology
    return wrapped


def refuse_parameters_in_two_optimizers(module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Stages 1 and 2: refuse a trainable parameter that two optimizers step, before either is sharded.

    Each ``ZeroOptimizer`` there lays its parameters out in flat buckets of its own (``FlatBucket``), and a parameter
    is a view into one bucket only: the second optimizer would take it from the first, whose step would then update
    a copy nobody reads (stage 1 trained silently wrong weights; stage 2 failed in backward). Stage 3's buckets belong
    to the sharded model, which every optimizer shares, so there it trains as DDP does."""
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        if isinstance(optimizer, ZeroOptimizer):
            params = [p for bucket in optimizer.buckets for p in bucket.params]
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            if not p.requires_grad or owner.setdefault(id(p), i) == i:
                continue
            first = owner[id(p)]
            name = parameter_names(module).get(id(p), f"of shape {tuple(p.shape)}")
            raise ValueError(
                f"Parameter {name!r} is stepped by two optimizers, #{first} ({type(optimizers[first]).__name__}) and "
                f"#{i} ({type(optimizer).__name__}). At ZeRO stages 1 and 2 each optimizer shards its parameters "
                "into flat buckets of its own, and a parameter lives in one bucket only. HINT: give each parameter "
                "to one optimizer, or use ZeroStrategy(stage=3), whose sharded parameters every optimizer shares."
            )


def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Every rank takes rank 0's buffers (Note [buffers follow rank 0] in ``lightning/strategy.py``)."""
    buffers = list(module.buffers())
    if buffers and group.size() > 1:
        # DDP's own coalesced broadcast, with its default bucket size (250 MiB).
        broadcast_coalesced(group, buffers, 250 * 1024 * 1024, 0)
