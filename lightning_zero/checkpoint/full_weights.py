"""Full (unsharded) weights, e.g. pretrained ones, loaded into a ZeRO model's shards: every rank reads only the
ranges it owns (Note [checkpoints stream through the tiers])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from os import PathLike

from lightning.pytorch.strategies import Strategy
from torch import Tensor, nn

from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.frozen import adapter_prefixes, source_path
from lightning_zero.checkpoint.pretrained import open_pretrained, pretrained_sources
from lightning_zero.checkpoint.slices import LoadPlan, owned_parameter_slices
from lightning_zero.checkpoint.storage import locate
from lightning_zero.checkpoint.tiered import TierStorage
from lightning_zero.sharding.sharded_optimizer import ShardedParameters, ZeroOptimizer

__all__ = ["load_full_state_dict", "load_pretrained", "refresh_gathered"]


def refresh_gathered(gatherer: ShardedParameters | None) -> None:
    if gatherer is not None:
        gatherer.refresh_gathered()  # a stage-3 unit gathered right now must not keep the weights from before


def load_full_state_dict(
    target: Strategy | nn.Module,
    state_dict: Mapping[str, Tensor] | str | PathLike[str],
    *,
    optimizers: Sequence[ZeroOptimizer] = (),
    prefix: str | None = None,
    strict: bool = True,
    tiers: TierStorage | None = None,
) -> None:
    """Load full (unsharded) weights, e.g. pretrained ones, into a ZeRO model; every rank calls it.

    ``target`` is a ``ZeroStrategy`` after setup (its LightningModule, optimizers and memory tiers are used) or a
    module wrapped by ``optimizers`` (with their memory ``tiers``, if any). ``state_dict`` is a mapping or a path: a
    ``.safetensors`` file, a Hugging Face checkpoint directory (``model.safetensors``, or the shards listed in
    ``model.safetensors.index.json``), or a ``torch.save`` file of a state dict or a Lightning checkpoint. Files are
    memory-mapped and each rank reads only the ranges it owns, one parameter at a time, straight into its shards or
    their tiers (Note [checkpoints stream through the tiers]). ``prefix`` is prepended to the file's keys to name the
    module's entries, e.g. ``"model."`` for the model a LightningModule holds as ``self.model``; None finds it (the
    one prefix under which every key of the file names an entry; ``checkpoint/pretrained.py``).
    """
    if isinstance(target, Strategy):
        if target.lightning_module is None:
            raise CheckpointError(
                f"load_full_state_dict got a {type(target).__name__} without a LightningModule. HINT: call it once "
                "the Trainer has set the strategy up, e.g. from the LightningModule's `on_fit_start` hook, or pass "
                "the file as `trainer.fit(model, ckpt_path=...)`."
            )
        module: nn.Module = target.lightning_module
        optimizers = [
            o for o in (getattr(o, "_optimizer", o) for o in target.optimizers) if isinstance(o, ZeroOptimizer)
        ]
        tiers = getattr(target, "memory_tiers", None)
        gatherer = getattr(target, "_gatherer", None)  # ZeroStrategy's stage-3 model, also without optimizers
        if hasattr(target, "pretrained_source"):  # recorded by checkpoints that leave frozen parameters out
            target.pretrained_source = source_path(state_dict)
    else:
        module, gatherer = target, None
    load_pretrained(module, state_dict, optimizers, gatherer, prefix=prefix, strict=strict, tiers=tiers)


def load_pretrained(
    module: nn.Module,
    state_dict: Mapping[str, Tensor] | str | PathLike[str],
    optimizers: Sequence[ZeroOptimizer],
    gatherer: ShardedParameters | None,
    *,
    prefix: str | None,
    strict: bool,
    tiers: TierStorage | None,
) -> None:
    """``load_full_state_dict`` into ``module``, sharded by ``optimizers`` and, at stage 3, by ``gatherer``."""
    origin = locate(state_dict if isinstance(state_dict, str | PathLike) else "<state_dict>")
    gatherer = gatherer or next((o.gatherer for o in optimizers if o.gatherer is not None), None)
    with ExitStack() as files:
        tensors = dict(state_dict) if isinstance(state_dict, Mapping) else open_pretrained(origin, files)
        module_state = module.state_dict(keep_vars=True)
        adapters = adapter_prefixes(module)
        sources, toc = pretrained_sources(module_state, tensors, prefix, origin, strict=strict, adapters=adapters)
        slices = owned_parameter_slices(optimizers, gatherer)
        plan = LoadPlan(module, slices, toc, strict=False, origin=origin, tiers=tiers)  # checked by name above
        plan.read_from(sources)
    plan.finish(optimizers)
    refresh_gathered(gatherer)
