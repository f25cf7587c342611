"""A model sharded for stage 3 by a front door: what ``ZeroStrategy`` (the Trainer's) and ``ZeroFabricStrategy``
(Fabric's) both do to it, written once.

- ``shard_for_stage3``: stage 3's sharding of a model (built normally or on meta) unit by unit, after the guard
  against sharding placeholders (``refuse_released_placeholders``); ``adopt_sharded``: the takeover of a model an
  earlier strategy of this process sharded; ``ranks_per_node``: the node size ZeRO++ and the metering by link need.
- ``install_module_state``: a stage-3 model's own ``state_dict``/``load_state_dict`` made true (Note [a stage-3
  model's state dict] in ``checkpoint/module_state.py``).
- ``serving``, ``calling``: the strategy collectives that serve a rank calling a model alone, and the calls that meet
  the other ranks first (Note [one-rank calls]): ``gathered_parameters()``, ``full_state_dict()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_zero.checkpoint.module_state import ModuleState
from lightning_zero.checkpoint.tiered import TierStorage
from lightning_zero.comm.topology import ranks_per_node_from_environment
from lightning_zero.compat import get_default_store
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.rank_layout import RankLayout
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.library_init import MetaDeviceExceptMetrics, ParamInitFn, pretrained_on_meta_hint
from lightning_zero.stage3.one_rank_calls import OneRankCalls
from lightning_zero.stage3.one_rank_calls import serving as serve_calls
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.sharded_init import shard_module


def ranks_per_node(config: ZeroConfig, num_processes: int, world_size: int) -> int | None:
    """``ZeroConfig.ranks_per_node``, else the launcher's (Note [node topology] in ``comm/topology.py``), else
    Lightning's processes per node; None on a single node."""
    per_node = config.ranks_per_node or ranks_per_node_from_environment() or num_processes
    return per_node if 0 < per_node < world_size else None


def shard_for_stage3(
    module: nn.Module,
    config: ZeroConfig,
    ranks: RankLayout,
    param_init_fn: ParamInitFn | None,
    tiers: MemoryTiers | None,
) -> ParameterGatherer:
    """Shard ``module`` for stage 3 unit by unit (``stage3/sharded_init.py``): one built on meta is materialized
    there, one built normally is moved to this rank's device a unit at a time (Note [partly meta models]), never
    whole. A model another strategy of this process sharded with the same config (an earlier ``Trainer``) keeps its
    shards: Note [a model sharded by an earlier Trainer]."""
    # ZeRO++ and the metering by link need the ranks per node; Lightning knows them when the environment does not.
    group = ranks.process_group
    config = dataclasses.replace(config, ranks_per_node=ranks_per_node(config, ranks.num_processes, group.size()))
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
    gatherer = shard_module(module, config, group, ranks.root_device, param_init_fn, tiers)
    if calls is not None:
        gatherer.attach_calls(calls)
    object.__setattr__(module, _SHARDED_BY, gatherer)
    return gatherer


def refuse_released_placeholders(module: nn.Module) -> None:
    """Refuse to shard a model another ``ZeroStrategy`` sharded for stage 3 (a previous ``Trainer``): its parameters
    are placeholders (Note [placeholders] in ``sharding/flat_bucket.py``), and sharding them again would train NaN
    weights."""
    name = next((n for n, p in module.named_parameters() if p.numel() > 1 and not any(p.stride())), None)
    if name is not None:
        raise ValueError(
            f"Parameter {name!r} is a released stage-3 placeholder: another ZeroStrategy (an earlier Trainer) "
            "sharded this model, and its shards are not this strategy's. HINT: run fit/validate/test on this model "
            "with the Trainer that sharded it, or build a fresh model and load the weights (a checkpoint's "
            "`ckpt_path`, or `lightning_zero.load_full_state_dict`)."
        )


def stage3_init_context(precision: AbstractContextManager[Any], empty_init: bool | None, where: str) -> ExitStack:
    """A stage-3 model built inside: with ``empty_init`` on the meta device, materialized unit by unit when it is
    sharded (``stage3/sharded_init.py``), so no rank ever holds the whole model; without, wherever the precision
    plugin's ``precision`` context puts it (the CPU, as under FSDP), and moved to the device unit by unit as it is
    sharded (Note [partly meta models]). ``where``: the call, as a pretrained load inside it names it."""
    stack = ExitStack()
    if empty_init:
        stack.enter_context(MetaDeviceExceptMetrics())  # Note [metrics stay off meta]
    stack.enter_context(precision)
    if empty_init:
        stack.enter_context(pretrained_on_meta_hint(where))
    return stack


def on_meta(module: nn.Module) -> bool:
    """Whether ``module`` has parameters or buffers on the meta device (built there for stage 3 to materialize)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


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


@contextmanager
def gathered_parameters(
    models: Iterable[tuple[nn.Module, ParameterGatherer | None]], module: nn.Module | None, writeback: bool
) -> Iterator[None]:
    """Full parameters of ``module`` (default: every model) on every rank inside the context: each of the
    ``(model, stage-3 gatherer)`` holding some of them meets the other ranks first (Note [one-rank calls]) and gathers
    them; ``writeback=True`` keeps changes. Stages 1 and 2 (no gatherer) hold full parameters already."""
    wanted = None if module is None else {id(p) for p in module.parameters()}
    with ExitStack() as stack:
        for model, gatherer in models:
            if gatherer is None or (wanted is not None and wanted.isdisjoint(id(p) for p in model.parameters())):
                continue
            stack.enter_context(calling([gatherer], "gathered_parameters()"))
            stack.enter_context(gatherer.gathered(module, writeback=writeback))
        yield


@contextmanager
def full_state_dicts(states: Iterable[ModuleState | None], offload_to_cpu: bool, rank0_only: bool) -> Iterator[None]:
    """Inside the context the stage-3 models of ``states`` give full tensors from ``state_dict()`` (on the CPU with
    ``offload_to_cpu``, only on rank 0 with ``rank0_only``): Note [a stage-3 model's state dict]. Collective."""
    with ExitStack() as stack:
        for state in states:
            if state is not None:
                stack.enter_context(state.full_state_dict(offload_to_cpu, rank0_only))
        yield
