"""``ShardedGradient``: a parameter's averaged gradient as ``.grad`` shows it where code reads gradients, computed from
the reduced shards; both front doors put it there (``trainer/visible_gradients.py``, ``fabric/visible_gradients.py``).

Note [gradients visible to hooks]
Lightning documents reading gradients in ``on_before_optimizer_step`` (``lightning.pytorch.utilities.grad_norm``,
logging a histogram, ``torch.nn.utils.get_total_norm``), and Fabric loops read them between ``fabric.backward`` and
the step; under FSDP2 that works because a parameter's ``.grad`` is a DTensor: a norm of it is a partial norm per rank
completed by a collective. ZeRO's averaged gradient exists only as the reduced shards (Note [reduced gradients live in
the optimizer] in ``trainer/precision.py``), so where a front door shows gradients, each parameter gets a
``ShardedGradient`` as ``.grad``: a tensor of the parameter's shape and dtype with no storage of its own, whose
operations run on the shards. A norm over the whole tensor (``.norm(p)``, ``torch.linalg.vector_norm``,
``torch._foreach_norm``) sums this rank's ``|g|^p`` (max for ``p = inf``) and completes it with one all-reduce of one
float64 per tensor, DDP's value as DTensor's is FSDP2's; ``.data``/``.detach()`` stay lazy; any other operation first
gathers the whole averaged gradient (one all-reduce of its size) and runs on it; a write is refused, because the step
reads the shards (the front door's ``GradientReads.hint`` names how to clip instead). Like FSDP2's DTensor gradients,
every rank must read the same gradients in the same order. A front door may finish the reduction at the first read
(``GradientReads.before_read``: Fabric, Note [gradients between backward and step]) and may let ``zero_()`` record a
``zero_grad(set_to_none=False)`` (``GradientReads.records_zeroing``), after which the gradient reads as zeros with no
collective, as DDP's zeroed ``.grad`` does. Objects are made once per optimizer and set again at every step: what
they read, this rank's pieces of the reduced gradient, is looked up when an operation runs (``segment_gradient``):
the masters' ``.grad``, or where the host tier keeps the masters in host memory (Note [host tier data path] in
``offload/host_copies.py``) the device shards it copies them from, which stay until the step, unscaled and clipped
as the step will read them. Stage 3's gradients on disk (Note [gradients on disk]) are not in memory before the
step; no front door shows them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.comm.collectives import all_reduce_sum
from lightning_zero.compat import make_wrapper_subclass, tree_map
from lightning_zero.offload.optimizer_tiers import OptimizerTiers
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


class GradientReads:
    """What a front door does around reads of the ``ShardedGradient``\\ s it shows (Note [gradients visible to
    hooks]). This base shows gradients already reduced (the Trainer's hooks run after the reduction)."""

    hint = ""
    """The fix a refused write names: how to clip through the front door."""
    records_zeroing = False
    """Whether ``zero_()`` is ``zero_grad(set_to_none=False)`` of the loop, recorded; else it is refused as a write."""

    def before_read(self, grads: list[ShardedGradient]) -> None:
        """Called on every rank before ``grads`` are read (a collective may follow): make their pieces final."""


class ShardedGradient(Tensor):
    """A parameter's averaged gradient as ``.grad`` shows it, computed from the shards (Note [gradients visible to
    hooks])."""

    _optimizer: ZeroOptimizer
    _reads: GradientReads
    _refs: list[tuple[int, int]]
    """``(offset, master)``: the parameter's flat elements from ``offset`` are ``optimizer.masters[master].grad``."""
    zeroed: bool
    """``zero_()`` was called since it was shown (only where ``GradientReads.records_zeroing``)."""

    @staticmethod
    def __new__(
        cls: type[ShardedGradient], param: Tensor, optimizer: ZeroOptimizer, reads: GradientReads
    ) -> ShardedGradient:
        grad = make_wrapper_subclass(cls, param)
        assert isinstance(grad, ShardedGradient)
        grad._optimizer, grad._reads, grad._refs, grad.zeroed = optimizer, reads, [], False
        return grad

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, pieces on this rank={len(self._refs)})"

    def pieces(self) -> list[tuple[int, Tensor]]:
        """``(offset, values)``: this rank's part of the averaged gradient at flat ``[offset, offset + numel)``."""
        return [(offset, g) for offset, i in self._refs if (g := segment_gradient(self._optimizer, i)) is not None]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # `.data`, `.detach()`
            return args[0]
        if func is torch.ops.aten.linalg_vector_norm.default and _whole_norm(args, kwargs):
            return _norms([args[0]], _order(args, kwargs))[0]
        if func is torch.ops.aten._foreach_norm.Scalar and all(isinstance(g, ShardedGradient) for g in args[0]):
            return _norms(list(args[0]), float(args[1]) if len(args) > 1 else 2.0)
        target = args[0] if args else None
        if (
            func is torch.ops.aten.zero_.default
            and isinstance(target, ShardedGradient)
            and target._reads.records_zeroing
        ):
            target.zeroed = True  # `zero_grad(set_to_none=False)`: Note [gradients between backward and step]
            return target
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func} would write a parameter's `.grad`, which under ZeRO shows the averaged gradient kept in the "
                "optimizer's shards (Note [gradients visible to hooks] in lightning_zero/engine/sharded_gradient.py): "
                f"the step would not see the write. {target._reads.hint if isinstance(target, ShardedGradient) else ''}"
            )
        grads = list({id(g): g for g in _flatten(args, kwargs) if not g.zeroed}.values())
        if grads:  # before any gathers: the front door may finish the reduction (Note [gradients visible to hooks])
            grads[0]._reads.before_read(grads)
        unwrap: Callable[[Any], Any] = lambda x: x.gathered() if isinstance(x, ShardedGradient) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def gathered(self) -> Tensor:
        """The whole averaged gradient, on every rank: one all-reduce of its size (zeros once ``zeroed``)."""
        if self.zeroed:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self._reads.before_read([self])
        # One dtype on every rank, whatever this rank holds (a rank may hold no piece): fp32 holds the fp32 masters'
        # gradients and low-precision ones exactly.
        full = torch.zeros(self.shape.numel(), dtype=torch.promote_types(self.dtype, torch.float32), device=self.device)
        for offset, values in self.pieces():
            full[offset : offset + values.numel()] = values.detach().reshape(-1)
        self._optimizer.ledger.record(all_reduce_sum(full, self._optimizer.group)).wait()
        return full.view(self.shape).to(self.dtype)


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[ShardedGradient]:
    found: list[ShardedGradient] = []
    tree_map(lambda x: found.append(x) if isinstance(x, ShardedGradient) else None, (args, kwargs))
    return found


def _order(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    return float(args[1] if len(args) > 1 else kwargs.get("ord", 2))


def _whole_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A norm over every element with a positive or infinite order, and no dtype, dim or keepdim given."""
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    rest = args[3:] if len(args) > 3 else ()
    order = _order(args, kwargs)
    return (dim is None or dim == []) and not any(rest) and not kwargs.get("keepdim") and kwargs.get("dtype") is None \
        and (order > 0 or order == math.inf)  # fmt: skip


def _norms(grads: list[ShardedGradient], order: float) -> list[Tensor]:
    """The ``order``-norm of each gradient from this rank's pieces, completed by one all-reduce for them all (a zeroed
    gradient adds nothing: it is zeroed on every rank)."""
    live = list({id(g): g for g in grads if not g.zeroed}.values())
    if live:
        live[0]._reads.before_read(live)
    optimizer = grads[0]._optimizer
    device = grads[0].device
    partial = torch.zeros(len(grads), dtype=torch.float64, device=device)
    for k, grad in enumerate(grads):
        for _, values in [] if grad.zeroed else grad.pieces():
            if values.numel() == 0:
                continue
            if order == math.inf:
                partial[k] = torch.maximum(partial[k], values.detach().abs().max().to(device, torch.float64))
            else:
                norm = torch.linalg.vector_norm(values.detach(), order, dtype=torch.float64).to(device)
                partial[k] += norm**order
    if order == math.inf:
        if optimizer.world_size > 1:
            dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=optimizer.group)
    else:
        optimizer.ledger.record(all_reduce_sum(partial, optimizer.group)).wait()
        partial = partial ** (1.0 / order)
    return [partial[k].to(grad.dtype) for k, grad in enumerate(grads)]


def segment_gradient(optimizer: ZeroOptimizer, i: int) -> Tensor | None:
    """Segment ``i``'s averaged gradient as the step will read it, once reduced (Note [gradients visible to hooks]):
    its master's ``.grad``; where the host tier keeps the masters, the device shard it copies them from (Note [host
    tier data path]), unscaled and clipped as the step will read it, to be read only. None: the segment got no
    gradient on any rank, or it is on disk until the step (Note [gradients on disk])."""
    tiers = optimizer.tiers
    segment = optimizer.segments[i]
    if not isinstance(tiers, OptimizerTiers) or not tiers.gradients.holds(segment.bucket):
        return optimizer.masters[i].grad
    # A tiered master's `.grad` is the tier's (a delayed update may still read the last step's): never shown.
    if not optimizer.segment_used[i] or not tiers.gradients.on_device(segment.bucket):
        return None
    shard = optimizer.reducer.grad_shard(segment.bucket)[segment.start : segment.stop]
    return tiers.gradients.as_read(shard, optimizer.masters[i].dtype)


def gradients_on_disk(optimizer: ZeroOptimizer) -> bool:
    """Whether some of the optimizer's reduced gradients are on disk until the step (Note [gradients on disk]):
    not in memory, so not shown."""
    tiers = optimizer.tiers
    if not isinstance(tiers, OptimizerTiers):
        return False
    return any(tiers.gradients.holds(b) and not tiers.gradients.on_device(b) for b in optimizer.buckets)


def sharded_gradients(
    optimizers: list[ZeroOptimizer], reads: GradientReads
) -> list[tuple[nn.Parameter, FlatBucket, int, ShardedGradient]]:
    """A ``ShardedGradient`` for every trainable parameter of ``optimizers``, with where its pieces are."""
    made: dict[int, tuple[nn.Parameter, FlatBucket, int, ShardedGradient]] = {}
    for optimizer in optimizers:
        trainable = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        for bucket in optimizer.buckets:
            for slot, param in enumerate(bucket.params):
                if id(param) in trainable and id(param) not in made:
                    made[id(param)] = (param, bucket, slot, ShardedGradient(param, optimizer, reads))
        for i, segment in enumerate(optimizer.segments):
            entry = made.get(id(segment.bucket.params[segment.slot]))
            if entry is not None and entry[3]._optimizer is optimizer:
                bucket = segment.bucket
                offset = bucket.rank * bucket.shard_numel + segment.start - bucket.slots[segment.slot].offset
                entry[3]._refs.append((offset, i))
    return list(made.values())
