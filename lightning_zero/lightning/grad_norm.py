"""``grad_norm``: Lightning's ``grad_norm`` (the gradient norms it documents logging in ``on_before_optimizer_step``)
with DDP's values under ZeRO, computed from the reduced gradient shards.

Note [gradient norms from shards]
Under ZeRO a parameter's ``.grad`` never holds its averaged gradient (Note [reduced gradients live in the optimizer]
in ``precision.py``): the averaged gradient exists only as each rank's shard, the ``ZeroOptimizer``'s masters'
``.grad``. ``grad_norm`` sums, on each rank, ``|g|^p`` (or takes ``max |g|`` for ``p = inf``) over the elements of
each parameter in its shard, for every parameter in the same order on every rank (``module.named_parameters()``),
and combines them in one all-reduce of one float64 per parameter; the ``p``-th root gives the norm of the full
averaged gradient, which is what ``torch.linalg.vector_norm`` of DDP's ``.grad`` gives. Which parameters have a
norm is decided as DDP's ``.grad is not None``: those some rank produced a gradient for since the last step (Note
[unused parameters] in ``sharding/gradient_presence.py``), a decision every rank shares. The total is computed from
the per-parameter norms exactly as Lightning computes it. Call it on every rank, after the gradients are reduced
(``on_before_optimizer_step``, or ``configure_gradient_clipping``).

Note [no partial gradients]
Stage 1 keeps full gradient buffers with each parameter's ``.grad`` a view into them (Note [full gradients between
steps] in ``sharding/full_grad_reducer.py``), and a reduction leaves this rank's averaged shard in its own slice and
zeros elsewhere (Note [reduced shard in place]). Read through ``.grad`` that is a partial gradient, a different wrong
number on each rank (Lightning's ``grad_norm`` logged 5.47 on rank 0, 1.95 on rank 1, where DDP's is 5.81). So once
a bucket's reduction is issued (at the end of a backward that synchronizes, and when the strategy finishes the
reduction before the step) its parameters' ``.grad`` is set to None, as at stages 2 and 3: ``on_after_backward``,
``on_before_optimizer_step`` and clipping hooks find no gradient rather than a wrong one. Nothing of ZeRO reads
``.grad`` there: the buffers stay referenced by the reducer, the step reads the reduced shard, and the next backward
finds ``.grad`` None as after ``zero_grad()`` and stores its gradient into the (zeroed) slot as it does then. A
bucket still accumulating (``no_sync``, or a reduction deferred to the step with ``overlap_comm=False``) keeps its
views: that is this rank's own unreduced gradient, as DDP's ``.grad`` inside ``no_sync``.

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
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm.collectives import all_reduce_sum
from lightning_zero.compat import make_wrapper_subclass, tree_map
from lightning_zero.sharding.activation_checkpointing import parameter_names
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_reducer import BucketState
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


def grad_norm(
    module: nn.Module,
    norm_type: float | int | str,
    group_separator: str = "/",
    optimizers: Iterable[Optimizer] | None = None,
) -> dict[str, Tensor]:
    """The ``norm_type`` norm of each parameter's averaged gradient and their total, with Lightning's keys
    (``grad_{p}_norm{group_separator}{name}`` and ``grad_{p}_norm_total``) and DDP's values, under any ZeRO stage:
    ``self.log_dict(lightning_zero.grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``.

    Args:
        module: the module whose parameters to measure (names are relative to it), e.g. ``self`` or ``self.layer``.
        norm_type: the ``p`` of the p-norm: a positive float, ``"inf"`` for the max norm.
        group_separator: between the key's prefix and the parameter's name, as Lightning's.
        optimizers: the ``ZeroOptimizer``s holding the gradients; default: ``module.trainer.optimizers`` when
            ``module`` is a LightningModule under ``ZeroStrategy``, else the LightningModule owning it must be given.

    Without ``ZeroOptimizer``s (another strategy) it is Lightning's ``grad_norm``. Call it on every rank: it runs one
    collective (Note [gradient norms from shards]).
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    if optimizers is None:
        attached = isinstance(module, LightningModule) and module._trainer is not None
        optimizers = module.trainer.optimizers if isinstance(module, LightningModule) and attached else []
    zero = [getattr(o, "_optimizer", o) for o in optimizers]  # LightningOptimizer wraps it in manual optimization
    zero_optimizers = [o for o in zero if isinstance(o, ZeroOptimizer)]
    if not zero_optimizers:
        # Lightning annotates its values as floats; they are 0-dim tensors.
        return {k: torch.as_tensor(v) for k, v in lightning_grad_norm(module, norm_type, group_separator).items()}
    ready = [o for o in zero_optimizers if o._grads_ready]
    if not ready:
        raise RuntimeError(
            "lightning_zero.grad_norm was called before the gradients were reduced: under ZeRO the averaged "
            "gradients exist only once the step's reduction has finished (Note [gradient norms from shards]). "
            "HINT: call it in `on_before_optimizer_step` (Lightning's documented place), on every rank."
        )
    # Each parameter's pieces of gradient in this rank's shard, and which parameters have a gradient at all.
    pieces: dict[int, list[Tensor]] = {}
    has_grad: set[int] = set()
    for optimizer in ready:
        trainable = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        for bucket in optimizer.buckets:
            for slot, param in enumerate(bucket.params):
                if id(param) in trainable and optimizer.presence.used(bucket, slot):
                    has_grad.add(id(param))
        for segment, master in zip(optimizer.segments, optimizer.masters, strict=True):
            if master.grad is not None:
                pieces.setdefault(id(segment.bucket.params[segment.slot]), []).append(master.grad)
            elif optimizer.tiers is not None and optimizer.tiers.holds_gradient(segment.bucket):
                raise NotImplementedError(
                    "lightning_zero.grad_norm cannot read gradients kept in a memory tier "
                    "(ZeroConfig.offload_optimizer): they stay there until the step. HINT: log the total norm "
                    "`Trainer(gradient_clip_val=...)` clips by, or measure without offload_optimizer."
                )
    names = parameter_names(module)  # the unwrapped model's names: Note [checkpoint wrappers keep the names]
    named = [(names[id(p)], p) for p in module.parameters() if id(p) in has_grad]
    if not named:
        return {}
    device = ready[0].buckets[0].device if ready[0].buckets else torch.device("cpu")
    infinite = norm_type == float("inf")
    combined = torch.zeros(len(named), dtype=torch.float64, device=device)  # on the device: no host sync per piece
    for k, (_, param) in enumerate(named):
        for g in pieces.get(id(param), []):
            if g.numel() == 0:
                continue
            if infinite:
                combined[k] = torch.maximum(combined[k], g.detach().abs().max().to(device, torch.float64))
            else:
                norm = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64).to(device)
                combined[k] += norm**norm_type
    if infinite:
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=ready[0].group)
    else:
        ready[0].ledger.record(all_reduce_sum(combined, ready[0].group)).wait()
        combined = combined ** (1.0 / norm_type)
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": combined[k].to(param.dtype)
        for k, (name, param) in enumerate(named)
    }
    # As Lightning's grad_norm: the total from the per-parameter norms.
    norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def hide_partial_gradients(optimizers: Iterable[ZeroOptimizer]) -> None:
    """Stage 1: set ``.grad`` to None for the parameters of every bucket whose reduction is issued (Note [no partial
    gradients])."""
    for optimizer in optimizers:
        if optimizer.config.stage != 1:
            continue
        state = optimizer.reducer.state
        for bucket in optimizer.buckets:
            if state[bucket.index] is not BucketState.FILLING:
                for param in bucket.params:
                    param.grad = None


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


# -- Note [gradients visible to hooks] -------------------------------------------------------------------------------
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
                "in the optimizer's shards (Note [gradients visible to hooks] in lightning_zero/lightning/grad_norm.py"
                "): the step would not see the write. HINT: clip through Lightning (`Trainer(gradient_clip_val=...)` "
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
