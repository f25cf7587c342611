"""``grad_norm``: Lightning's ``grad_norm`` (the gradient norms it documents logging in ``on_before_optimizer_step``)
with DDP's values under ZeRO, computed from the reduced gradient shards.

Note [gradient norms from shards]
Under ZeRO a parameter's ``.grad`` never holds its averaged gradient (Note [reduced gradients live in the optimizer]
in ``trainer/precision.py``): the averaged gradient exists only as each rank's shard, the ``ZeroOptimizer``'s masters'
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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm.collectives import all_reduce_sum
from lightning_zero.engine.sharded_gradient import gradients_on_disk, segment_gradient
from lightning_zero.sharding.activation_checkpointing import parameter_names
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
        if gradients_on_disk(optimizer):
            raise NotImplementedError(
                "lightning_zero.grad_norm cannot read gradients kept on disk (stage 3 with ZeroConfig."
                "offload_optimizer='disk', Note [gradients on disk]): they stay there until the step. HINT: log the "
                "total norm `Trainer(gradient_clip_val=...)` clips by, or measure with offload_optimizer='cpu'."
            )
        for i, segment in enumerate(optimizer.segments):
            grad = segment_gradient(optimizer, i)  # the host tier's: its device shard (Note [host tier data path])
            if grad is not None:
                pieces.setdefault(id(segment.bucket.params[segment.slot]), []).append(grad)
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
