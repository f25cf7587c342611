"""The autograd side of a stage-3 unit: finding the tensors a module takes and returns, and knowing when its
backward has finished.

Note [post-backward]
A unit may be freed only when autograd is done with its parameters, and that is not when its trainable parameters'
gradients have arrived: computing the gradient of the unit's *input* reads its parameters too, frozen ones included
(a frozen ``LayerNorm`` before a trainable ``Linear``, the frozen base layer of a LoRA adapter). The unit's inputs
that require grad are therefore passed through ``PostBackward``, an identity whose backward runs once autograd has
produced the gradients of those inputs, i.e. once the unit's whole backward is over; that is where the unit is freed
(as FSDP2 does). A unit none of whose inputs requires grad computes no input gradient: it is done when its trainable
gradients have arrived, or, if it has none, it is never needed in backward at all (autograd does not reach it).
Except inside a reentrant checkpoint's recomputation: its backward (a nested one) computes the gradients of the
segment's inputs as well, which require grad whatever the unit's own inputs did (a LoRA model's frozen embedding
output made to require grad; a segment inside the unit, or the unit called only in segments, whose forward ran
without grad and hooked nothing). There the last trainable gradient arrives while the segment's backward still reads
the unit's frozen weights, so a unit is not freed on arrivals in a nested backward: its ``REENTRANT`` post-backward
or the end of the backward frees it. Likewise in any backward when the unit's forward made a tensor require grad
that is no parameter (``enable_input_require_grads`` on a frozen embedding inside the unit): its gradient is computed
through the unit's weights after the trainable ones may have arrived. Such a unit is found after its forward, from
the leaves its outputs' graph reaches (``only_parameters_reached``), and waits for the end of the backward. Not
the root unit: its outputs' graph is the whole model's, and walking it after every forward cost O(model) on the step's
critical path (6.7 ms at 24 layers); the root is freed at the end of the backward instead, as FSDP2 frees its root
(its last gradient, the embedding's, arrives there in a language model anyway).
Reducing a unit's gradients is separate from freeing it: buckets are reduced as their gradients arrive, whatever
happens to the parameters.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_zero.sharding.gradient_arrivals import in_nested_backward


def tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor inside ``value``: nested tuples, lists, dicts, dataclasses (Hugging Face's ``ModelOutput`` is
    a dict), and named tuples. A unit returning any such structure must still get its pre-backward gather."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


def _replace_tensors(value: Any, replace: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with every tensor that requires grad replaced, rebuilding the containers it sits in."""
    if isinstance(value, Tensor):
        return replace(value) if value.requires_grad else value
    if isinstance(value, dict):
        rebuilt = {key: _replace_tensors(item, replace) for key, item in value.items()}
        if type(value) is dict:
            return rebuilt
        copy = value.copy()  # OrderedDict, ModelOutput: keep the type and its attributes
        copy.update(rebuilt)
        return copy
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_replace_tensors(item, replace) for item in value))
    if isinstance(value, list | tuple):
        return type(value)(_replace_tensors(item, replace) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        return dataclasses.replace(value, **{name: _replace_tensors(getattr(value, name), replace) for name in fields})
    return value


def only_parameters_reached(outputs: Iterable[Tensor]) -> bool:
    """Whether every leaf that requires grad reached by backpropagating from ``outputs`` is an ``nn.Parameter``
    (Note [post-backward])."""
    seen: set[Any] = set()
    stack: list[Any] = []
    for t in outputs:
        if t.grad_fn is None:  # a leaf itself
            if not isinstance(t, torch.nn.Parameter):
                return False
        else:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if variable is not None:
            if not isinstance(variable, torch.nn.Parameter):
                return False
            continue
        stack.extend(f for f, _ in node.next_functions if f is not None)
    return True


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward calls ``callback`` once their gradients exist.

    See Note [post-backward]."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        # Views, not the inputs themselves: an autograd Function that returns an input unchanged would be taken for
        # an in-place operation on it.
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def hook_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], callback: Callable[[], None]) -> tuple[Any, Any, bool]:
    """(args, kwargs, hooked): the inputs with every tensor that requires grad routed through one ``PostBackward``,
    so that ``callback`` runs when the module's backward is over. ``hooked`` is False when no input requires grad."""
    tensors = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not tensors:
        return args, kwargs, False
    unique = list({id(t): t for t in tensors}.values())
    routed = dict(zip((id(t) for t in unique), PostBackward.apply(callback, *unique), strict=True))
    new_args, new_kwargs = _replace_tensors((args, kwargs), lambda t: routed[id(t)])
    return new_args, new_kwargs, True


class Registration(enum.IntEnum):
    """Where a unit's ``PostBackward`` was registered, which decides which backward runs it."""

    FORWARD = 0
    """The step's forward: the step's backward runs it."""
    REENTRANT = 1
    """A reentrant checkpoint's recomputation, inside backward: that recomputation's own backward runs it."""
    OTHER = 2
    """Another recomputation in backward (a non-reentrant checkpoint's), never backpropagated through."""

    @staticmethod
    def now(in_backward: bool) -> Registration:
        if not in_backward:
            return Registration.FORWARD
        return Registration.REENTRANT if in_nested_backward() else Registration.OTHER


class PostBackwardCounts:
    """Per unit, the ``PostBackward`` hooks of the current step by ``Registration`` and how many have run: the one
    that ends a unit's backward is found from counts every rank shares (Note [one order of collectives] in
    ``comm/streams.py``). Reset at the end of every backward."""

    def __init__(self, units: Iterable[int]) -> None:
        units = list(units)
        self._registered = {u: [0] * len(Registration) for u in units}
        self._ran = {u: [0] * len(Registration) for u in units}

    def registered(self, unit: int, where: Registration) -> None:
        self._registered[unit][where] += 1

    def ran(self, unit: int, where: Registration) -> bool:
        """Count a hook of ``unit`` that has run; True when it is the last one registered ``where`` (never for
        ``OTHER``): the unit's backward is over for those uses."""
        self._ran[unit][where] += 1
        return where is not Registration.OTHER and self._ran[unit][where] == self._registered[unit][where]

    def reset(self) -> None:
        for counts in (*self._registered.values(), *self._ran.values()):
            counts[:] = [0] * len(Registration)
