"""``.grad`` between ``fabric.backward`` and the step: each trainable parameter's averaged gradient as a
``ShardedGradient`` (Note [gradients visible to hooks] in ``engine/sharded_gradient.py``), reduced at the first read.

Note [gradients between backward and step]
Fabric loops read gradients between ``fabric.backward(loss)`` and ``optimizer.step()``: a gradient norm logged with
``torch.nn.utils.get_total_norm`` or Lightning's ``grad_norm``, a ``p.grad is not None`` filter, histograms. Under
Fabric's DDP ``.grad`` holds the averaged gradient there; under ZeRO it lives in the shards. So after every
``fabric.backward`` that synchronizes a model (outside its ``fabric.no_backward_sync``), each trainable parameter of
the model's optimizers gets its ``ShardedGradient`` as ``.grad``; frozen parameters keep None. Which parameters show
one is decided from what every rank shares (``requires_grad`` at setup), never from this rank's arrivals, so every rank
filters the same ``.grad is not None`` and issues the same collectives. A parameter that got no gradient on any rank
since the last step reads as zeros, where DDP leaves None (Fabric's DDP refuses such a parameter by default).

The reduction is not finished at the backward: a loop may call ``fabric.backward`` again before the step (the Fabric
DCGAN example backpropagates two losses into its discriminator), and a finished reduction cannot take more. The first
read that needs values (a norm, a copy, any operation but ``.data``/``.detach()``) finishes it, on every rank alike, as
``fabric.clip_gradients`` does. After that, a ``fabric.backward`` that adds to those gradients before the step or
``zero_grad()`` is refused as it ends (seen by the presence flags it sets): their masters were taken and possibly
clipped, and the new gradients would be lost (bf16-mixed) or misreduced (stage 1); a backward that reaches only other
optimizers' parameters (a value network's, after the policy's were clipped) is left alone, and an optimizer whose
finished reduction found no gradient on any rank (a GAN's generator read after the discriminator's backward) starts
over, nothing lost. A write to a
``ShardedGradient`` is refused (``fabric.clip_gradients`` clips), but ``zero_()`` is ``model.zero_grad(set_to_none=
False)``: recorded, read as zeros, applied as Note [model.zero_grad() reaches the shards] applies a ``zero_grad()``;
there the watched parameters' ``ShardedGradient``\\ s are the markers. ``optimizer.step()`` consumes the gradients
(``ZeroOptimizer.step``) and takes its ``ShardedGradient``\\ s out; a reference kept from before reads nothing and is
refused. Before each backward every ``.grad`` shown gets back what ZeRO had there (None, or at stage 1 with
``overlap_comm=False`` the view autograd accumulates into).

Inside ``fabric.no_backward_sync`` nothing is reduced yet, so nothing is shown: stage 1 keeps its full gradient buffers
with ``.grad`` views of them, this rank's local partial sum, as DDP's ``.grad`` inside ``no_sync``; stages 2 and 3
keep None (or a marker), as FSDP2's sharded parameters keep their ``.grad`` while it accumulates unsharded gradients.
The host tier's gradients (Note [host tier data path]) are shown from the device shards it copies to host memory,
which stay until the step, as the step will read them (unscaled, clipped); stage 3's gradients on disk (Note
[gradients on disk]) are not in memory before the step: none are shown, with a warning once. The cost is one
Python assignment per parameter per synchronizing backward and per step (a few microseconds per tensor:
``benchmarks/visible_gradients.py``), plus the collectives of what the loop reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning.fabric.utilities import rank_zero_warn
from torch import Tensor
from torch.nn import Parameter

from lightning_zero.comm.collectives import all_reduce_sum
from lightning_zero.engine.sharded_gradient import (
    GradientReads,
    ShardedGradient,
    gradients_on_disk,
    sharded_gradients,
)
from lightning_zero.fabric.models import SetUpModels
from lightning_zero.fabric.zero_grad import engine_call
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer


class LoopGradients(GradientReads):
    """The ``ShardedGradient``\\ s a Fabric loop sees between ``fabric.backward`` and the step (Note [gradients between
    backward and step])."""

    hint = (
        "HINT: clip with `fabric.clip_gradients(model, optimizer, max_norm=...)` (or `clip_val=...`), and read "
        "gradients without changing them."
    )
    records_zeroing = True

    def __init__(self, models: SetUpModels) -> None:
        self._models = models
        self._made: dict[int, tuple[ZeroOptimizer, list[tuple[Parameter, ShardedGradient]]]] = {}
        """``id(optimizer)`` -> it and its parameters' ``ShardedGradient``s, made at its first show."""
        self._shown: list[tuple[Parameter, ShardedGradient, Tensor | None]] = []
        """``(parameter, shown, what .grad held before)``."""
        self._live: set[int] = set()
        """The optimizers whose gradients are shown now."""
        self._finished: list[tuple[ZeroOptimizer, bytes]] = []
        """During a backward: the optimizers whose gradients were already reduced, with this rank's presence flags."""
        self._warned = False

    def show(self) -> None:
        """After ``fabric.backward``: the gradients of every model it synchronized."""
        for model in self._models:
            if not all(r.require_sync for r in model.reducers()):
                continue  # accumulating inside fabric.no_backward_sync: nothing is reduced yet
            for optimizer in model.optimizers:
                if id(optimizer) in self._live:
                    continue
                if gradients_on_disk(optimizer):
                    self._warn_once()  # Note [gradients on disk]
                    continue
                watched = {id(p) for p in model.watched.get(id(optimizer), [])}
                for param, grad in self._of(optimizer):
                    before = param.grad
                    param.grad, grad.zeroed = grad, False
                    self._shown.append((param, grad, before))
                    if before is None and id(param) in watched:  # Note [model.zero_grad() reaches the shards]
                        model.markers[id(param)] = grad
                self._live.add(id(optimizer))

    def hide(self, only: ZeroOptimizer | None = None) -> None:
        """``.grad`` back to what ZeRO had there, for ``only``'s parameters (None: every one shown)."""
        kept = []
        for param, grad, before in self._shown:
            if only is not None and grad._optimizer is not only:
                kept.append((param, grad, before))
            elif param.grad is grad:  # else the loop replaced it (`zero_grad()`): leave that
                param.grad = None if grad.zeroed else before
        self._shown = kept
        self._live = {id(o) for o in {id(g._optimizer): g._optimizer for _, g, _ in kept}.values()}

    def apply_zeroing(self, only: ZeroOptimizer | None = None) -> None:
        """Before a backward, and before ``only``'s step: zero the gradients of each optimizer whose shown gradients a
        ``zero_grad(set_to_none=False)`` zeroed, as it would have zeroed DDP's; refuse one that zeroed part of them."""
        zeroed: dict[int, tuple[ZeroOptimizer, list[bool]]] = {}
        for _, grad, _ in self._shown:
            if only is None or grad._optimizer is only:
                zeroed.setdefault(id(grad._optimizer), (grad._optimizer, []))[1].append(grad.zeroed)
        for optimizer, flags in zeroed.values():
            if all(flags):
                optimizer.zero_grad(set_to_none=False)
            elif any(flags):
                raise RuntimeError(
                    f"The gradients of part of {type(optimizer.optimizer).__name__}'s parameters were zeroed "
                    "(`zero_grad(set_to_none=False)` of a submodule): ZeRO holds the averaged gradients in shards "
                    "that parameters share, and cannot zero some of them. HINT: zero the whole model's gradients, "
                    "`model.zero_grad()` or its optimizers' `zero_grad()`."
                )

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Around a call into ZeRO that may empty ``.grad`` where it completes a reduction: what was shown is put
        back."""
        held = [(param, grad) for param, grad, _ in self._shown if param.grad is grad]
        try:
            yield
        finally:
            for param, grad in held:
                if param.grad is None:
                    param.grad = grad

    def before_read(self, grads: list[ShardedGradient]) -> None:
        optimizers = list({id(g._optimizer): g._optimizer for g in grads}.values())
        stale = next((o for o in optimizers if id(o) not in self._live), None)
        if stale is not None:
            raise RuntimeError(
                f"A `.grad` of {type(stale.optimizer).__name__}'s parameters was read after `optimizer.step()` or "
                "the next `fabric.backward`: under ZeroFabricStrategy the step consumes the averaged gradient, which "
                "lives in the optimizer's shards (Note [gradients between backward and step] in "
                "lightning_zero/fabric/visible_gradients.py). HINT: read `p.grad` again after `fabric.backward`, "
                "before the step; keep a value you need later with `.clone()`."
            )
        pending = [o for o in optimizers if not o._grads_ready]
        if pending:
            with torch.no_grad(), engine_call(self._models), self.kept():
                for optimizer in pending:  # the same order on every rank: the loop reads the same gradients
                    optimizer.reduce_gradients()

    def before_backward(self) -> None:
        """Watch the optimizers whose gradients a read or a clip has reduced; let one whose reduction found no
        gradient anywhere start over (Note [gradients between backward and step])."""
        for optimizer in self._models.optimizers:
            if not optimizer._grads_ready:
                continue
            if not optimizer.presence.any:
                optimizer.zero_grad()
                continue
            self._finished.append((optimizer, optimizer.presence.swap_local()))

    def after_backward(self, refuse: bool = True) -> None:
        """Refuse, on every rank, a backward that added to gradients already reduced on some rank (Note [gradients
        between backward and step]); ``refuse=False``: only give the flags back (the backward raised)."""
        finished, self._finished = self._finished, []
        arrived = [any(optimizer.presence.swap_local(flags)) for optimizer, flags in finished]
        if not finished or not refuse:
            return
        # Every rank is in this state alike (reads and clips are collective); the arrivals are decided together, so
        # that every rank raises, none waits for the others. Once per backward in this state only, never in a
        # steady step.
        counts = torch.tensor(arrived, dtype=torch.float32, device=finished[0][0]._device)
        finished[0][0].ledger.record(all_reduce_sum(counts, finished[0][0].group)).wait()
        for (optimizer, _), count in zip(finished, counts.tolist(), strict=True):
            if count > 0:
                raise RuntimeError(
                    f"`fabric.backward` reached parameters of {type(optimizer.optimizer).__name__} after their "
                    "gradients were reduced (read through `.grad`, or clipped with `fabric.clip_gradients`) and "
                    "before its `optimizer.step()` or `zero_grad()`: ZeRO had taken the averaged gradient into the "
                    "optimizer's shards and cannot add another backward's to it (Note [gradients between backward "
                    "and step] in lightning_zero/fabric/visible_gradients.py). HINT: call every `fabric.backward` of a "
                    "step before reading or clipping its gradients (accumulate inside `fabric.no_backward_sync`), or "
                    "step first."
                )

    def _of(self, optimizer: ZeroOptimizer) -> list[tuple[Parameter, ShardedGradient]]:
        made = self._made.get(id(optimizer))
        if made is None or made[0] is not optimizer:  # an optimizer set up again (a second one of its model)
            found = sharded_gradients([optimizer], self)
            made = self._made[id(optimizer)] = (optimizer, [(param, grad) for param, _, _, grad in found])
        return made[1]

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                "The gradients are kept on disk until the optimizer step (stage 3 with ZeroConfig.offload_optimizer="
                "'disk', Note [gradients on disk]), so between `fabric.backward` and the step no `.grad` is shown. "
                "HINT: log the total norm `fabric.clip_gradients(...)` returns, or measure with "
                "offload_optimizer='cpu' (the host tier), whose gradients are shown."
            )
