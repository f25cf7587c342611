"""The hooks of torch's ``Optimizer`` on ``ZeroOptimizer``, a wrapper that does not call ``Optimizer.__init__``.

Note [step hooks]
``register_step_pre_hook``/``register_step_post_hook`` (and torch's global optimizer hooks) work on the
``ZeroOptimizer`` and run once per ``step()``. The wrapped optimizer's own update is called without torch's hook
wrapper, once per chunk, and the hooks registered on the wrapped optimizer itself run once around the whole step, so
code that holds the optimizer from ``configure_optimizers`` sees one step too. State-dict hooks run on both objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.optim import Optimizer

_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def init_hook_registries(wrapper: Optimizer) -> None:
    """The hook registries ``Optimizer.__init__`` would create, which ``Optimizer.register_*_hook`` fill."""
    for name in _REGISTRIES:
        setattr(wrapper, name, OrderedDict[int, Callable[..., Any]]())


def state_dict_with_hooks(wrapper: Optimizer, inner: Optimizer) -> dict[str, Any]:
    """``inner``'s state dict (its own hooks run inside), with ``wrapper``'s state-dict hooks around it."""
    for pre_hook in wrapper._optimizer_state_dict_pre_hooks.values():
        pre_hook(wrapper)
    state_dict = inner.state_dict()
    for post_hook in wrapper._optimizer_state_dict_post_hooks.values():
        changed = post_hook(wrapper, state_dict)
        state_dict = changed if changed is not None else state_dict
    return state_dict


def load_state_dict_with_hooks(wrapper: Optimizer, inner: Optimizer, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``inner`` (its own hooks run inside), with ``wrapper``'s load hooks around it."""
    for pre_hook in wrapper._optimizer_load_state_dict_pre_hooks.values():
        changed = pre_hook(wrapper, state_dict)
        state_dict = changed if changed is not None else state_dict
    inner.load_state_dict(state_dict)
    for post_hook in wrapper._optimizer_load_state_dict_post_hooks.values():
        post_hook(wrapper)


@contextmanager
def inner_step_hooks(inner: Optimizer) -> Iterator[None]:
    """Run the step hooks registered on the wrapped optimizer once around the whole (chunked) step."""
    for hook in getattr(inner, "_optimizer_step_pre_hooks", {}).values():
        hook(inner, (), {})
    yield
    inner._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's step() checks for
    for hook in getattr(inner, "_optimizer_step_post_hooks", {}).values():
        hook(inner, (), {})


def without_step_hooks(step: Callable[..., Any]) -> Callable[..., Any]:
    """The optimizer class's ``step`` without torch's hook-running wrapper."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]
