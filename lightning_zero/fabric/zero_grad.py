"""``model.zero_grad()`` on a set-up model reaches the gradients ZeRO holds for it.

Note [model.zero_grad() reaches the shards]
Fabric loops zero gradients with the model's ``zero_grad()`` as often as with the optimizer's (Lightning's Fabric
DCGAN example: ``discriminator.zero_grad()`` before the discriminator's backward passes). Under DDP that sets every
``.grad`` to None. Under ZeRO a reduced gradient lives in the reducer (a bucket's shard, or stage 1's flat buffer
with ``.grad`` hidden, Note [no partial gradients] in ``engine/grad_norm.py``), not in ``.grad``, so
``nn.Module.zero_grad`` finds nothing to clear, and what a backward left since the model's optimizers last stepped
would be added to the next step. In the DCGAN loop that is the discriminator's gradient of the generator's loss: the
discriminator would step on it, silently, where DDP drops it.

So after each ``fabric.backward`` the strategy puts a *marker* in the empty ``.grad`` of two trainable parameters of
each set-up optimizer, both in the first of its buckets (the first and the last of its parameters there): a tensor of
the parameter's shape and dtype with no storage (``GradientMarker``), which any operation refuses, naming the
parameter: read as a gradient it would be a wrong number (it once was zeros, which a loop reading ``.grad`` between
backward and step took for the gradient). A ``zero_grad()`` of the model sets them to None, or with
``set_to_none=False`` zeroes them, which the marker records. At the next
``fabric.backward`` (before any gradient is accumulated), and at that optimizer's step (before its gradients are read),
the strategy finds them gone and zeroes the optimizer's gradients with its own ``zero_grad()`` (every rank alike: the
loop's calls are the same on every rank); before a backward it takes the other markers out, as autograd cannot
accumulate into them. ZeRO itself empties ``.grad`` where it completes a reduction (stage 3 may complete the last bucket
at the first clip or step): around those calls the markers it empties are put back (``engine_call``). The optimizer's
own ``zero_grad()`` takes both out too (ZeRO empties ``.grad`` of a bucket it zeroes whole, and of both or neither of
the two), so zeroing again is harmless. One marker gone and the other not is a ``zero_grad()`` of part of the model
splitting that bucket, which ZeRO cannot apply to a shared bucket: refused. A ``zero_grad()`` of a submodule that does
not hold them is not seen: zero a set-up model's gradients whole. The checks are two identity tests per optimizer,
whatever the model's size. Under stage 1 a ``.grad`` that still holds an unreduced gradient (inside
``no_backward_sync``) keeps it, and a ``zero_grad()`` that replaces it is seen by the reducer itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.compat import disabled_torch_function_impl, make_wrapper_subclass
from lightning_zero.engine.sharded_gradient import ShardedGradient
from lightning_zero.fabric.models import SetUpModel
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


def watched(optimizer: ZeroOptimizer) -> list[Parameter]:
    """The parameters whose ``.grad`` carries ``optimizer``'s markers: its first and last trainable ones in its first
    bucket holding any."""
    own = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for bucket in optimizer.buckets:
        mine = [p for p in bucket.params if id(p) in own and p.requires_grad]
        if mine:
            return list({id(p): p for p in (mine[0], mine[-1])}.values())
    return []


def mark(models: Iterable[SetUpModel]) -> None:
    """After a backward: a marker in each watched parameter's empty ``.grad``."""
    for model in models:
        for params in model.watched.values():
            for param in params:
                if param.grad is None:
                    param.grad = _marker(param)
                    model.markers[id(param)] = param.grad


@contextmanager
def engine_call(models: Iterable[SetUpModel]) -> Iterator[None]:
    """Around a call into ZeRO that may empty the ``.grad`` of parameters it reduces (a reduction completed for a
    clip or a step): the markers intact before it are put back after it, so that only the loop's ``zero_grad()``
    takes them."""
    intact = [(m, p) for m in models for ps in m.watched.values() for p in ps if _marked(m, p)]
    yield
    for model, param in intact:
        if param.grad is None:
            param.grad = _marker(param)
            model.markers[id(param)] = param.grad
        elif param.grad is not model.markers[id(param)]:  # a gradient of its own now (stage 1's views)
            del model.markers[id(param)]


class GradientMarker(Tensor):
    """What ``.grad`` of a watched parameter holds between a backward and ``zero_grad()`` (Note [model.zero_grad()
    reaches the shards]): no values. ``zero_()`` (``zero_grad(set_to_none=False)``) is recorded; any other operation is
    refused, as the gradient it would stand for is in ZeRO's shards."""

    zeroed: bool

    @staticmethod
    def __new__(cls: type[GradientMarker], param: Parameter) -> GradientMarker:
        marker = make_wrapper_subclass(cls, param)
        assert isinstance(marker, GradientMarker)
        marker.zeroed = False
        return marker

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradientMarker(shape={tuple(self.shape)}, dtype={self.dtype}, zeroed={self.zeroed})"

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.zero_.default and isinstance(args[0], GradientMarker):
            args[0].zeroed = True
            return args[0]
        raise RuntimeError(
            f"{func} on the `.grad` of a parameter set up by ZeroFabricStrategy where no gradient is shown: inside "
            "`fabric.no_backward_sync` (this rank's unreduced gradients, held by ZeRO at stages 2 and 3), after "
            "the step consumed them, or at stage 3 with offload_optimizer='disk' (the gradients are on disk until "
            "the step, Note [gradients on disk]). `.grad` only marks that `zero_grad()` has not been called since "
            "(Note [model.zero_grad() reaches the shards] in lightning_zero/fabric/zero_grad.py). HINT: read "
            "gradients after a `fabric.backward` outside `no_backward_sync` and before the step (Note [gradients "
            "between backward and step]); `fabric.clip_gradients(...)` returns their total norm."
        )


def _marked(model: SetUpModel, param: Parameter) -> bool:
    return id(param) in model.markers and param.grad is model.markers[id(param)] and not _zeroed(param)


def _zeroed(param: Parameter) -> bool:
    # A ShardedGradient is the marker where it is shown: Note [gradients between backward and step]
    return isinstance(param.grad, GradientMarker | ShardedGradient) and param.grad.zeroed


def _marker(param: Parameter) -> Tensor:
    return GradientMarker(param)


def apply_zero_grad(models: Iterable[SetUpModel], only: ZeroOptimizer | None = None) -> None:
    """Zero the gradients of each optimizer (``only``: that one, before its step) whose markers a ``zero_grad()``
    took; before a backward (``only`` None) take the other markers out too."""
    for model in models:
        for optimizer in model.optimizers:
            if only is not None and optimizer is not only:
                continue
            marked = [p for p in model.watched.get(id(optimizer), []) if id(p) in model.markers]
            gone = [p for p in marked if p.grad is not model.markers[id(p)] or _zeroed(p)]
            if gone and len(gone) < len(marked):
                name = next(n for n, p in model.module.named_parameters() if p is gone[0])
                raise RuntimeError(
                    f"The gradients of part of {type(model.module).__name__} were zeroed (`zero_grad()` of a "
                    f"submodule holding {name!r}): ZeRO holds the reduced gradients in buckets that parameters share,"
                    " and cannot zero some of them. HINT: zero the whole model's gradients, `model.zero_grad()` or "
                    "its optimizers' `zero_grad()`."
                )
            if gone:
                optimizer.zero_grad()
            gone_ids = {id(p) for p in gone}
            for param in marked:
                if id(param) in gone_ids or only is None:
                    if param.grad is model.markers[id(param)]:
                        param.grad = None
                    del model.markers[id(param)]
