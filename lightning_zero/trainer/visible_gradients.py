"""``.grad`` shown to the Trainer's ``on_before_optimizer_step`` hooks as the averaged gradient, a ``ShardedGradient``
computed from the reduced shards (Note [gradients visible to hooks] in ``engine/sharded_gradient.py``), as
``ZeroPrecision`` shows it around those hooks.

Each parameter that has a gradient (DDP's ``.grad is not None``, Note [unused parameters]) gets its
``ShardedGradient`` after the reduction, and loses it before clipping (``configure_gradient_clipping`` keeps the None
of Note [no partial gradients]), and only when the LightningModule or a callback overrides
``on_before_optimizer_step``: a run whose hooks cannot read them pays nothing, one that overrides the hook one Python
object per parameter per step, plus the collectives of what it reads. The hooks run on every rank, so every rank
reads the same gradients. The host tier's gradients are shown from the device shards it copies from (Note [host
tier data path]). Stage 3's gradients on disk are not in memory before the step (Note [gradients on disk]); those stay
None, with a warning the first time, naming ``lightning_zero.grad_norm``'s limits.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_zero.engine.sharded_gradient import (
    GradientReads,
    ShardedGradient,
    gradients_on_disk,
    sharded_gradients,
)
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


class _HookReads(GradientReads):
    """The hooks run after the reduction; a write is refused with the Trainer's way to clip."""

    hint = (
        "HINT: clip through Lightning (`Trainer(gradient_clip_val=...)` or `self.clip_gradients(...)` in "
        "`configure_gradient_clipping`), and read gradients without changing them."
    )


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
            self._made = {key: sharded_gradients(ready, _HookReads())}  # the optimizers of this fit: built once
        if any(gradients_on_disk(o) for o in ready):
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
                "The gradients are kept on disk until the optimizer step (stage 3 with ZeroConfig."
                "offload_optimizer='disk', Note [gradients on disk]), so `on_before_optimizer_step` hooks find "
                "every `.grad` None. HINT: log the total norm `Trainer(gradient_clip_val=...)` clips by, or measure "
                "with offload_optimizer='cpu' (the host tier), whose gradients are shown; `lightning_zero.grad_norm` "
                "refuses gradients on disk too."
            )


def _hook_reads_gradients(model: pl.LightningModule) -> bool:
    """Whether the LightningModule or a callback overrides ``on_before_optimizer_step``, where Lightning documents
    reading gradients."""
    if is_overridden("on_before_optimizer_step", model):
        return True
    trainer = model._trainer
    callbacks = getattr(trainer, "callbacks", [])
    return any(is_overridden("on_before_optimizer_step", c, parent=pl.Callback) for c in callbacks)
