"""``ZeroOptimizer``: the user's optimizer, stepping only this rank's shard of the model (every stage).

Construction takes a model and an optimizer built over its parameters, exactly as the user wrote it, and:

1. finds the flat buckets holding the trainable parameters: for stages 1 and 2 it flattens them itself, one bucket
   per param group and dtype; for stage 3 the model was already sharded unit by unit (``stage3.sharded_init``);
2. cuts this rank's shard of each bucket into *segments*, contiguous runs of elements of one param group, and gives
   each an fp32 master (the parameter shard itself when the parameters are fp32: no second copy);
3. re-targets the user's optimizer *in place*: each param group's ``params`` become its segments' masters and its
   state is emptied, so optimizer state is only ever allocated for 1/N of the model. Hyper-parameters, LR
   schedulers, ``ReduceLROnPlateau`` and anything else holding the optimizer object keep working unchanged;
4. hands gradients to a ``GradientReducer`` (full buffers for stage 1, sharded for stages 2 and 3).

A step is: finish the gradient reduce-scatters -> master grads -> the user's ``optimizer.step()`` on the shards ->
copy masters into the parameter shards -> all-gather the resident buckets in place (stage 3 gathers the others
when they are next used); at stage 3, and at stages 1 and 2 with ``overlap_comm``, bucket by bucket
(Note [step in chunks] in ``step_chunks.py``).
Gradient clipping: ``gradient_clipping.py``; torch's optimizer hooks: Note [step hooks] in ``optimizer_hooks.py``;
parameters without gradient: Note [unused parameters] in ``gradient_presence.py``; memory tiers: Note [tiered step]
in ``state_tiers.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm.collectives import ProcessGroup, all_gather, all_reduce_sum
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.compat import non_finite_check_and_unscale_
from lightning_zero.config import ZeroConfig
from lightning_zero.sharding import gradient_clipping
from lightning_zero.sharding.flat_bucket import build_buckets
from lightning_zero.sharding.full_grad_reducer import FullGradReducer
from lightning_zero.sharding.gradient_presence import GradientPresence
from lightning_zero.sharding.gradient_reducer import GradientReducer
from lightning_zero.sharding.loss_scaler import DynamicLossScaler
from lightning_zero.sharding.optimizer_hooks import (
    init_hook_registries,
    inner_step_hooks,
    load_state_dict_with_hooks,
    state_dict_with_hooks,
    without_step_hooks,
)
from lightning_zero.sharding.param_edits import ParamEdits
from lightning_zero.sharding.param_groups import (
    MasterRun,
    ParamGroupView,
    copy_masters_to_shards,
    masters_for,
    segments_of,
    trainable_named_groups,
)
from lightning_zero.sharding.sharded_grad_reducer import ShardedGradReducer
from lightning_zero.sharding.sharded_parameters import ShardedParameters as ShardedParameters  # re-exported
from lightning_zero.sharding.state_tiers import StateTiers
from lightning_zero.sharding.step_chunks import StepChunk, build_step_chunks, publish_in_flight, step_in_chunks
from lightning_zero.sharding.trainable_parameters import TrainableParameters

# Stages compose by choosing where gradients live; everything else is shared. (Stage 3 adds parameter gathering on
# top of stage 2's reducer, built with the sharded model.)
_REDUCERS: dict[int, type[GradientReducer]] = {1: FullGradReducer, 2: ShardedGradReducer}


class ZeroOptimizer(Optimizer):
    """Wraps ``optimizer`` so that it holds optimizer state and master weights for this rank's shard only.

    ``gatherer`` is the stage-3 sharded model (``sharded_init.shard_module``); stages 1 and 2 pass None.
    ``fp32_masters=False`` steps the parameters' own dtype (``bf16-true``). ``loss_scaler`` (``16-mixed``): this
    optimizer's own scaler; the gradients are unscaled after reduction and a step any rank finds non-finite is
    skipped by every rank.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        process_group: ProcessGroup,
        config: ZeroConfig,
        gatherer: ShardedParameters | None = None,
        *,
        fp32_masters: bool = True,
        loss_scaler: DynamicLossScaler | None = None,
        tiers: StateTiers[ZeroOptimizer] | None = None,
    ) -> None:
        # Optimizer.__init__ is not called: the param groups, state and defaults are the wrapped optimizer's own
        # objects, so reading or changing a learning rate through either object is the same thing.
        self.optimizer = optimizer
        self.module = module
        self.group = process_group
        self.config = config
        self.gatherer = gatherer
        self.loss_scaler = loss_scaler
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self._readiness = [False]  # behind `_grads_ready`
        self._found_inf = False
        self._views = [ParamGroupView(g, list(g["params"])) for g in optimizer.param_groups]
        self.trainable = TrainableParameters(p for view in self._views for p in view["params"])
        """Which parameters are reduced, sharded and stepped: decided here, once."""

        named_groups = trainable_named_groups(module, optimizer, config.elementwise_optimizers)
        group_of = {id(p): g for g, named in enumerate(named_groups) for _, p in named}
        self.reducer: GradientReducer
        if gatherer is None:
            self.ledger = CommLedger()
            """What this optimizer's collectives moved; ``ledger.last_step`` is the last step's record."""
            self.buckets = build_buckets(
                named_groups, config.bucket_numel, self.rank, self.world_size, list(module.parameters())
            )
            self._broadcast_from_rank0()
            self.reducer = _REDUCERS[config.stage](self.buckets, process_group, config, self.ledger)
            self.resident_buckets = self.buckets
        else:
            self.ledger = gatherer.ledger  # one record of the step: gathers, reduce-scatters, resident all-gathers
            self.reducer = gatherer.reducer
            mine = [b for b in gatherer.reducer.buckets if any(id(p) in group_of for p in b.params)]
            self.buckets = mine
            self.resident_buckets = [b for b in mine if b.resident]
        self.segments = [seg for b in self.buckets for seg in segments_of(b, group_of)]
        self.gradient_owner = self.reducer.owners.claim(
            self.buckets, [(s.bucket, s.start, s.stop) for s in self.segments]
        )
        """Its claim on the reducer's gradients, which stage 3 shares between optimizers (Note [gradients of
        several optimizers] in ``gradient_owners.py``)."""
        self.masters: list[Tensor]
        """This rank's fp32 master weights, one per segment (a view of the parameter shard when fp32)."""
        if tiers is None:
            self.masters, self._runs = masters_for(self.segments, fp32_masters)
        else:  # the tiers place the buckets and build their masters where they live (Note [tiered step])
            self.masters, self._runs = tiers.masters_for(self.buckets, self.segments, fp32_masters)
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [m for seg, m in zip(self.segments, self.masters, strict=True) if seg.group == g]
        optimizer.state.clear()
        self.segment_used = [True] * len(self.segments)
        """Whether each segment got a gradient on some rank this step (Note [unused parameters])."""
        self.tiers = tiers
        """Where the masters and optimizer state of some buckets live between steps (Note [tiered step])."""
        self._step_chunks: list[StepChunk] = []
        """Stage 3, tiers, and stages 1 and 2 with ``overlap_comm``: each bucket's segments' groups, masters and
        master runs, stepped one bucket at a time (Note [step in chunks]); empty when the step runs in one piece."""
        overlap = config.overlap_comm and self.world_size > 1
        if tiers is not None or (len(self.buckets) > 1 and (gatherer is not None or overlap)):
            self._step_chunks = build_step_chunks(self.buckets, self.segments, self.masters, self._runs)
        init_hook_registries(self)  # Note [step hooks]
        self.presence = GradientPresence(self.buckets, group_of, self.reducer.present, self.reducer.arrivals)
        """Which parameters got a gradient since the last step (Note [unused parameters])."""
        self._raw_step = without_step_hooks(type(optimizer).step)  # Note [step hooks]
        self.edits = ParamEdits(self.buckets)
        """Which shards were edited between steps (Note [edits reach the masters])."""
        for bucket in {id(run.bucket): run.bucket for run in self._runs}.values():
            self.edits.watch(bucket, runs=[run for run in self._runs if run.bucket is bucket])
        if tiers is not None:
            tiers.attach(self)  # watches its own buckets

    @property
    def _grads_ready(self) -> bool:
        """Whether this step's gradients are reduced into the masters' ``.grad``. Kept in a list: Fabric's optimizer
        wrapper derives its class from this one, so ``zero_grad()`` called on the wrapper runs with the wrapper as
        ``self``, and a plain attribute written there would never reach this object."""
        return self._readiness[0]

    @_grads_ready.setter
    def _grads_ready(self, ready: bool) -> None:
        self._readiness[0] = ready

    @property
    def _device(self) -> torch.device:
        """Where the gradients are reduced and the step's flags and norms are summed (host-tier masters are not)."""
        return self.buckets[0].device if self.buckets else torch.device("cpu")

    @property
    def master_runs(self) -> list[MasterRun]:
        """The separate fp32 masters, per run of segments (empty when the parameters are their own masters)."""
        return self._runs

    # -- the Optimizer surface -----------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[ParamGroupView]:  # type: ignore[override]
        return self._views

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.config.stage}, world_size={self.world_size}, {self.optimizer!r})"

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next backward outside reduces (gradient accumulation)."""
        with self.reducer.no_sync():
            yield

    def reduce_gradients(self) -> None:
        """Finish the gradient reduction and expose the averaged shards as the masters' ``.grad``.

        Runs once per step; the strategy calls it right after the closure so that hooks and gradient clipping that
        run before ``step()`` already see the reduced (and, with loss scaling, unscaled) gradients. A parameter that
        no rank produced a gradient for keeps ``.grad = None`` (Note [unused parameters]).
        """
        if self._grads_ready:
            return
        self.reducer.finish()
        grads: list[Tensor | None] = []
        for seg, master in zip(self.segments, self.masters, strict=True):
            if self.tiers is not None and self.tiers.holds_gradient(seg.bucket):
                grads.append(None)  # in the tier until the step reads it: Note [tiered step]
                continue
            grad = self.reducer.grad_shard(seg.bucket)[seg.start : seg.stop]
            grads.append(grad if grad.dtype == master.dtype else grad.to(master.dtype))
        device = self._device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        present = [g for g in grads if g is not None]
        inv_scale = None if self.loss_scaler is None else 1.0 / self.loss_scaler.scale_of_gradients
        if inv_scale is not None and present:
            non_finite_check_and_unscale_(present, found, torch.full_like(found, inv_scale))
        if self.tiers is not None:  # the tiered gradients' overflow check and unscaling: Note [tiered step]
            self.tiers.gradients_reduced(found, inv_scale)
        # One collective decides both, identically on every rank: (1 + parameters,) of 0/1 flags, summed. Its sum is
        # read (a host synchronization) only for the overflow flag or when this rank lacks a gradient: Note [unused
        # parameters].
        flags = torch.cat([found, self.presence.local_flags(device)])
        self.ledger.record(all_reduce_sum(flags, self.group)).wait()
        if self.loss_scaler is None and self.presence.all_arrived_here():
            self._found_inf = False
            self.presence.decide(None)
        else:
            decided = flags.tolist()
            self._found_inf = self.loss_scaler is not None and decided[0] > 0
            self.presence.decide(decided[1:])
        for i, (seg, master, reduced) in enumerate(zip(self.segments, self.masters, grads, strict=True)):
            self.segment_used[i] = self.presence.used(seg.bucket, seg.slot)
            master.grad = reduced if self.segment_used[i] else None
        self._grads_ready = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm over all shards and param groups: what ``torch.nn.utils.clip_grad_norm_`` computes on
        the full gradients of a DDP model. Returns that total norm."""
        gradient_clipping.check_clip_value(max_norm, "norm")
        self.reduce_gradients()
        grads = [m.grad for m in self.masters if m.grad is not None]
        tiered = self.tiers.gradient_norms(norm_type) if self.tiers is not None else []  # Note [tiered step]
        norm = gradient_clipping.total_norm(grads, norm_type, self.group, self.ledger, self._device, tiered)
        coefficient = gradient_clipping.clip_coefficient(norm, max_norm)
        gradient_clipping.scale_(grads, coefficient)
        if self.tiers is not None:
            self.tiers.set_gradient_transform(coefficient, None)
        return norm

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] (element-wise: shards need no communication)."""
        gradient_clipping.check_clip_value(clip_value, "value")
        self.reduce_gradients()
        gradient_clipping.clamp_([m.grad for m in self.masters if m.grad is not None], clip_value)
        if self.tiers is not None:
            self.tiers.set_gradient_transform(None, clip_value)

    @Optimizer.profile_hook_step  # this optimizer's step hooks and torch's global ones: Note [step hooks]
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce gradients, step this rank's shard, all-gather the updated parameters.

        The step consumes the gradients (as DeepSpeed's engine does): the next step starts from zero whether or not
        ``zero_grad()`` is called. Only this optimizer's: another one of the model keeps its own (Note [gradients
        of several optimizers] in ``gradient_owners.py``). A parameter that received no gradient on any rank is
        left alone, as by DDP (Note [unused parameters]); a step without any gradient changes nothing. Parameters
        edited since the last step are stepped from their edited values (Note [edits reach the masters]). With loss
        scaling, a step whose gradients overflowed on any rank is skipped on every rank and the scale backs off.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        self.trainable.check(self.module, type(self.optimizer).__name__)
        self.edits.check()
        if self.tiers is None:  # with tiers: each bucket's while the tiers hold it (Note [tiered step])
            self.edits.adopt_all()  # a masked copy on the device, no host read (Note [edits reach the masters])
        skip = self._found_inf or not self.presence.any
        if not skip:
            with inner_step_hooks(self.optimizer):  # Note [step hooks]
                if self._step_chunks:
                    step_in_chunks(
                        self.optimizer,
                        self._raw_step,
                        self._step_chunks,
                        self.tiers,
                        self.ledger,
                        self.group,
                        self.edits,
                    )
                else:
                    self._raw_step(self.optimizer)
                    copy_masters_to_shards(self._runs)
                    self.edits.record_all()
                    self.gather_parameters()
            if self.gatherer is not None:
                self.gatherer.refresh_gathered()  # units still in use must not keep pre-step weights
        if self.loss_scaler is not None and self.presence.any:
            self.loss_scaler.update(self._found_inf)
        self._end_of_step()
        self.ledger.end_step()
        return loss

    def settle(self) -> None:
        """Publish the tiers' delayed update still in flight, if any (Note [delayed parameter update] in
        ``offload/host_steps.py``): afterwards parameters, masters and optimizer state are those after every step
        taken. Collective: every rank calls it at the same point."""
        if self.tiers is not None and self.tiers.in_flight():
            publish_in_flight(self._step_chunks, self.tiers, self.ledger, self.group, self.edits)
            self.tiers.end_step()

    def _end_of_step(self) -> None:
        self.reducer.consume(self.gradient_owner)  # Note [gradients of several optimizers]
        self._forget_gradients()
        if self.tiers is not None:
            self.tiers.end_step()

    def gather_parameters(self) -> None:
        """All-gather every resident bucket from its shard into the full flat parameters (after a step or a load)."""
        pending = []
        for bucket in self.resident_buckets:
            assert bucket.data is not None
            pending.append(self.ledger.record(all_gather(bucket.data, bucket.param_shard, self.group)))
        for p in pending:
            p.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero this optimizer's gradients (Note [gradients of several optimizers]). Stage 1 keeps its flat
        gradient buffers allocated (they are autograd's accumulation target); stages 2 and 3 free their gradient
        shards when ``set_to_none`` (Note [gradient shards between steps]). A parameter without gradient until the
        next step is then skipped, as after torch's ``zero_grad()``."""
        self.reducer.zero_grad(set_to_none, self.gradient_owner)  # Note [gradients of several optimizers]
        self._forget_gradients()

    def _forget_gradients(self) -> None:
        for master in self.masters:
            master.grad = None
        self.presence.reset()
        self._grads_ready = False
        if self.loss_scaler is not None:
            self.loss_scaler.gradient_scale = None  # Note [one loss scale per optimizer]

    def _broadcast_from_rank0(self) -> None:
        """Start from rank 0's weights, as DDP does, so ranks seeded differently still train one model."""
        if self.world_size == 1:
            return
        source = dist.get_global_rank(self.group, 0)
        for bucket in self.buckets:
            assert bucket.data is not None
            dist.broadcast(bucket.data, src=source, group=self.group)

    # -- state dicts: this rank's shard only (sharded checkpointing composes these per rank) ---------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state; with memory tiers, a copy in memory of the state they hold (the tensors in
        a tier have no memory between uses, Note [tiered step]). Checkpoints do not call this: they stream."""
        if self.tiers is None:
            return state_dict_with_hooks(self, self.optimizer)
        self.settle()
        self.tiers.load_all()
        try:
            state_dict = state_dict_with_hooks(self, self.optimizer)
            state_dict["state"] = {
                i: {k: v.clone() if isinstance(v, Tensor) else v for k, v in entries.items()}
                for i, entries in state_dict["state"].items()
            }
        finally:
            self.tiers.unload_all()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.settle()
        load_state_dict_with_hooks(self, self.optimizer, state_dict)
        # torch replaces the group dicts on load: point the user-facing views at the new ones.
        self._views = [
            ParamGroupView(g, v["params"]) for g, v in zip(self.optimizer.param_groups, self._views, strict=True)
        ]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "ZeroOptimizer does not support add_param_group after sharding. HINT: create every param group in "
            "`configure_optimizers` (or before wrapping the optimizer)."
        )
