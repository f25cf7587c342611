"""``.grad`` shown to the Trainer's ``on_before_optimizer_step`` hooks as the averaged gradient, computed from the
reduced shards (``ShardedGradient``, ``VisibleGradients``), as ``ZeroPrecision`` shows it around those hooks.

Note [gradients visible to hooks]
Lightning documents reading gradients in ``on_before_optimizer_step`` (``lightning.pytorch.utilities.grad_norm``,
logging a histogram, ``torch.nn.utils.get_total_norm``), and under FSDP2's strategy that works because a parameter's
``.grad`` is a DTensor: a norm of it is a partial norm per rank completed by a collective. ZeRO's averaged gradient
exists only as the reduced shards (Note [reduced gradients live in the optimizer] in ``precision.py``), so around
those hooks, and only there, each parameter that has a gradient (DDP's ``.grad is not None``, Note [unused
parameters]) gets a ``ShardedGradient`` as ``.grad``: a tensor of the parameter's shape and dtype with no storage of
its own, whose operations run on the shards. A norm over the whole tensor (``.norm(p)``, ``torch.linalg.vector_norm``,
``torch._foreach_norm``) sums this rank's ``|g|^p`` (max for ``p = inf``) and completes it with one all-reduce of one
float64 per tensor, DDP's value as DTensor's is FSDP2's; ``.data``/``.detach()`` stay lazy; any other operation first
gathers the whole averaged gradient (one all-reduce of its size) and runs on it; a write is refused, because the step
reads the shards (clip through Lightning). Like FSDP2's DTensor gradients, every rank must read the same gradients in
the same order: the hooks run on every rank. They are set after the reduction and removed before clipping
(``configure_gradient_clipping`` keeps the None of Note [no partial gradients]), and only when the LightningModule or
a callback overrides ``on_before_optimizer_step``: a run whose hooks cannot read them pays nothing, one that overrides
the hook one Python object per parameter per step, plus the collectives of what it reads. Gradients held in a memory
tier on disk are not in memory before the step (Note [gradients on disk]); those stay None, with a warning the first
time, naming ``lightning_zero.grad_norm``'s limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_zero.comm.collectives import all_reduce_sum
from lightning_zero.compat import make_wrapper_subclass, tree_map
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


class ShardedGradient(Tensor):
    """A parameter's averaged gradient as ``.grad`` shows it to Lightning's hooks, computed from the shards (Note
    [gradients visible to hooks]). Made once per parameter and set again at every step: what it reads, this rank's
    pieces of the reduced gradient, is looked up when an operation runs."""

    _optimizer: ZeroOptimizer
    _refs: list[tuple[int, int]]
    """``(offset, master)``: the parameter's flat elements from ``offset`` are ``optimizer.masters[master].grad``."""

    @staticmethod
    def __new__(cls: type[ShardedGradient], param: Tensor, optimizer: ZeroOptimizer) -> ShardedGradient:
        grad = make_wrapper_subclass(cls, param)
        assert isinstance(grad, ShardedGradient)
        grad._optimizer, grad._refs = optimizer, []
        return grad

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, pieces on this rank={len(self._refs)})"

    def pieces(self) -> list[tuple[int, Tensor]]:
        """``(offset, values)``: this rank's part of the averaged gradient at flat ``[offset, offset + numel)``."""
        masters = self._optimizer.masters
        return [(offset, g) for offset, i in self._refs if (g := masters[i].grad) is not None]

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
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func} would write a parameter's `.grad`, which under ZeroStrategy shows the averaged gradient kept "
                "in the optimizer's shards (Note [gradients visible to hooks] in "
                "lightning_zero/trainer/visible_gradients.py): the step would not see the write. HINT: clip through "
                "Lightning (`Trainer(gradient_clip_val=...)` "
                "or `self.clip_gradients(...)` in `configure_gradient_clipping`), and read gradients without "
                "changing them."
            )
        unwrap: Callable[[Any], Any] = lambda x: x.gathered() if isinstance(x, ShardedGradient) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def gathered(self) -> Tensor:
        """The whole averaged gradient, on every rank: one all-reduce of its size."""
        pieces = self.pieces()
        dtype = pieces[0][1].dtype if pieces else self.dtype
        full = torch.zeros(self.shape.numel(), dtype=dtype, device=self.device)
        for offset, values in pieces:
            full[offset : offset + values.numel()] = values.detach().reshape(-1)
        self._optimizer.ledger.record(all_reduce_sum(full, self._optimizer.group)).wait()
        return full.view(self.shape).to(self.dtype)


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
    """The ``order``-norm of each gradient from this rank's pieces, completed by one all-reduce for them all."""
    optimizer = grads[0]._optimizer
    device = grads[0].device
    partial = torch.zeros(len(grads), dtype=torch.float64, device=device)
    for k, grad in enumerate(grads):
        for _, values in grad.pieces():
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


class VisibleGradients:
    """Shows each reduced gradient as its parameter's ``.grad`` (a ``ShardedGradient``) around Lightning's
    ``on_before_optimizer_step`` hooks, and hides it again (Note [gradients visible to hooks])."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, ...], list[tuple[nn.Parameter, FlatBucket, int, ShardedGradient]]] = {}
        self._shown: list[nn.Parameter] = []
        self._warned = False

    def show(self, model: pl.LightningModule, optimizers: Iterable[ZeroOptimizer]) -> None:
        """Set the ``.grad`` of every parameter with a reduced gradient, if a hook can read them."""
        ready = [o for o in optimizers if o._grads_ready]
        if not ready or not _hook_reads_gradients(model):
            return
        key = tuple(id(o) for o in ready)
        if key not in self._made:
            self._made = {key: _sharded_gradients(ready)}  # the optimizers of this fit: built once
        if any(o.tiers is not None and any(m.grad is None for m in o.masters) for o in ready):
            self._warn_once()  # Note [gradients on disk]: not in memory before the step
            return
        for param, bucket, slot, grad in self._made[key]:
            if param.grad is None and grad._optimizer.presence.used(bucket, slot):
                param.grad = grad
                self._shown.append(param)

    def hide(self) -> None:
        for param in self._shown:
            param.grad = None
        self._shown = []

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                "The gradients are kept in a memory tier on disk until the optimizer step (ZeroConfig."
                "offload_optimizer='disk', Note [gradients on disk]), so `on_before_optimizer_step` hooks find "
                "every `.grad` None. HINT: log the total norm `Trainer(gradient_clip_val=...)` clips by, or measure "
                "without offload_optimizer='disk'; `lightning_zero.grad_norm` refuses these gradients too."
            )


def _sharded_gradients(
    optimizers: list[ZeroOptimizer],
) -> list[tuple[nn.Parameter, FlatBucket, int, ShardedGradient]]:
    """A ``ShardedGradient`` for every trainable parameter of ``optimizers``, with where its pieces are."""
    made: dict[int, tuple[nn.Parameter, FlatBucket, int, ShardedGradient]] = {}
    for optimizer in optimizers:
        trainable = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        for bucket in optimizer.buckets:
            for slot, param in enumerate(bucket.params):
                if id(param) in trainable and id(param) not in made:
                    made[id(param)] = (param, bucket, slot, ShardedGradient(param, optimizer))
        for i, segment in enumerate(optimizer.segments):
            entry = made.get(id(segment.bucket.params[segment.slot]))
            if entry is not None and entry[3]._optimizer is optimizer:
                bucket = segment.bucket
                offset = bucket.rank * bucket.shard_numel + segment.start - bucket.slots[segment.slot].offset
                entry[3]._refs.append((offset, i))
    return list(made.values())


def _hook_reads_gradients(model: pl.LightningModule) -> bool:
    """Whether the LightningModule or a callback overrides ``on_before_optimizer_step``, where Lightning documents
    reading gradients."""
    if is_overridden("on_before_optimizer_step", model):
        return True
    trainer = model._trainer
    callbacks = getattr(trainer, "callbacks", [])
    return any(is_overridden("on_before_optimizer_step", c, parent=pl.Callback) for c in callbacks)
