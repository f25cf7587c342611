"""A training step of the user's own model on fake tensors: every tensor it creates, alive or freed, and no memory.

Note [the step on fake tensors]
torch's ``FakeTensorMode`` runs any op on tensors that have a shape, a dtype and a device but no storage, computing
what the real op would return. ``fake_copy`` builds a copy of the user's module whose parameters and buffers are
such tensors (in the dtype the precision gives them, on the device the run will use), from a real model or one
built on meta, without copying a byte of it; the step runs there as the user wrote it (``training_step``, the
model's own forward, autocast, activation-checkpoint wrappers and their recomputation), and ``loss.backward()``
runs autograd over it. ``LiveBytes``, a dispatch mode under the fake mode, sees every tensor an op returns, counts
its storage once (views and in-place results share it) and drops it when the storage dies (a weak reference), so
its count is the bytes the step holds at each moment: activations saved for backward, temporaries, the gradients
autograd produces. The engine's own memory (gathered units, gradient buckets, shards), which plain torch would not
allocate, is added by ``engine_replay`` at the moments the engine allocates and frees it. What the fake mode cannot
run (an op reading a value on the host, such as ``.item()`` on a computed tensor) fails the prediction, naming the
op, rather than guessing.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_zero.compat import FakeTensorMode, TorchDispatchMode, tree_flatten, tree_map_only

KINDS = ("parameters", "gradients", "optimizer_state", "activations", "buffers")
"""The categories a predicted peak is split into (``PeakBytes``)."""


class PeakBytes(NamedTuple):
    """Bytes held by one rank at its peak, by kind."""

    parameters: int
    """Parameters held between steps (full at stages 1-2, shards at stage 3) and units gathered at the peak."""
    gradients: int
    """Gradient buffers and shards, gradients autograd computed and not yet reduced, receive buffers."""
    optimizer_state: int
    """fp32 master weights and the optimizer's own state (Adam's moments), and the temporaries of its step."""
    activations: int
    """Tensors the model's forward and backward create: saved activations, temporaries, the batch."""
    buffers: int
    """The module's buffers (positional tables, masks, norm statistics), held whole on every rank."""

    @property
    def total(self) -> int:
        return sum(self)

    def __add__(self, other: object) -> PeakBytes:
        assert isinstance(other, PeakBytes)
        return PeakBytes(*(a + b for a, b in zip(self, other, strict=True)))


class LiveBytes(TorchDispatchMode):
    """The bytes a step holds, by kind, at every moment, and the peak of their sum.

    Tensors returned by ops are counted as activations until ``mark_gradient`` moves them (autograd's gradients);
    ``add``/``remove`` count the engine's allocations that the ops do not make (Note [the step on fake tensors]).
    """

    def __init__(self, base: PeakBytes) -> None:
        super().__init__()
        self._base = base
        self._live = dict.fromkeys(KINDS, 0)
        self._storages: dict[int, tuple[weakref.ref[Any], int, str]] = {}
        self.peak = base
        """The bytes by kind at the moment their sum was largest."""

    def _update(self) -> None:
        now = PeakBytes(**self._live) + self._base
        if now.total > self.peak.total:
            self.peak = now

    def add(self, kind: str, nbytes: int) -> None:
        self._live[kind] += nbytes
        self._update()

    def remove(self, kind: str, nbytes: int) -> None:
        self._live[kind] -= nbytes

    def _track(self, tensor: Tensor, kind: str) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._storages:
            return
        nbytes = storage.nbytes()

        def released(_: object, key: int = key) -> None:
            entry = self._storages.pop(key, None)
            if entry is not None:
                self._live[entry[2]] -= entry[1]

        self._storages[key] = (weakref.ref(storage, released), nbytes, kind)
        self.add(kind, nbytes)

    def exclude(self, tensors: Iterable[Tensor]) -> None:
        """Never count these tensors' storages (the model's parameters and buffers, which the prediction counts
        from the layout), also when an op returns a view of one (``weight.t()``)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._storages[id(storage)] = (weakref.ref(storage), 0, "activations")

    def mark_gradient(self, tensor: Tensor) -> None:
        """Count ``tensor`` (a gradient autograd computed) as a gradient from now on."""
        entry = self._storages.get(id(tensor.untyped_storage()))
        if entry is not None and entry[2] != "gradients":
            self._live[entry[2]] -= entry[1]
            self._live["gradients"] += entry[1]
            self._storages[id(tensor.untyped_storage())] = (entry[0], entry[1], "gradients")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._track(t, "activations")
        return out


def release_fake_tensors() -> None:
    """Free what the fake steps leave behind: the fake mode's cache of op results (shared by every ``FakeTensorMode``
    of the process) and the copies' reference cycles, before the real run allocates."""
    FakeTensorMode.cache_clear()
    gc.collect()


def fake_mode() -> FakeTensorMode:
    # Real tensors a model keeps outside its parameters and buffers (a constant in an attribute) become fake on use.
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_copy(module: nn.Module, mode: FakeTensorMode, device: torch.device, param_dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are fake tensors on ``device`` (Note [the step on fake
    tensors]): floating parameters in ``param_dtype`` as ZeRO's precision holds them, buffers in their own dtype,
    ties kept. The module itself is untouched; a Trainer or Fabric it refers to is shared, not copied."""
    memo: dict[int, Any] = {}
    with mode:
        for p in module.parameters():
            dtype = param_dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=p.requires_grad)
        for b in module.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
    _share_owners(module, memo)
    return copy.deepcopy(module, memo)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device (shapes, dtypes, ties; no memory), for the strategy's layout, which
    uses the copy up. The module itself is untouched; a Trainer or Fabric it refers to is shared, not copied."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    _share_owners(module, memo)
    return copy.deepcopy(module, memo)


def _share_owners(module: nn.Module, memo: dict[int, Any]) -> None:
    for name in ("_trainer", "_fabric", "_fabric_optimizers"):
        shared = getattr(module, name, None)
        if shared is not None:
            memo[id(shared)] = shared


def fake_batch(batch: Any, mode: FakeTensorMode, device: torch.device) -> Any:
    """``batch`` (any nesting of tensors) as fake tensors on ``device``."""
    with mode:
        return tree_map_only(Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), batch)


def tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))


@contextmanager
def logging_off(module: nn.Module) -> Iterator[None]:
    """A LightningModule's ``self.log``/``self.log_dict`` do nothing: a fake loss must not reach the loggers."""
    names = [n for n in ("log", "log_dict") if callable(getattr(module, n, None))]
    for name in names:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in names:
            delattr(module, name)


def loss_of(output: Any) -> Tensor:
    """The loss in what a training step returns: a tensor, or Lightning's ``{"loss": tensor, ...}``."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"The training step returned {type(output).__name__}, not a loss tensor or a dict with 'loss'. HINT: "
            "the memory prediction runs one training step; it needs the loss that backward starts from."
        )
    return loss


StepFn = Callable[[nn.Module, Any], Tensor]
"""The forward of the user's step on the (fake) module and a (fake) batch, returning the loss, inside the caller's
precision context (autocast)."""
