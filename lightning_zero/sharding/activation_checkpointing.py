"""Activation checkpointing by policy (``ZeroConfig.activation_checkpointing_policy``), applied as FSDP's strategies
apply theirs: the modules the policy selects are wrapped in torch's non-reentrant checkpoint wrapper, in place,
before stage 3 forms its units. Plain functions of a module, so that any front end (the Trainer's ``ZeroStrategy``,
a Fabric strategy) applies the same policy the same way.

Note [checkpoint wrappers keep the names]
torch's checkpoint wrapper holds the module it wraps as ``_checkpoint_wrapped_module``, so ``named_parameters()``
gains that segment in the name of every parameter under it, while its state-dict hooks remove it from
``state_dict()`` keys and put it back on ``load_state_dict``. ZeRO names the parameters of its buckets, its optimizer
state and its checkpoints by ``named_parameters()`` and matches those names against ``state_dict()`` keys and
against the keys of full checkpoints, so every such name comes from ``parameter_names`` (or, for a module,
``state_dict_name`` of its ``named_modules()`` name): the names, and therefore the checkpoints, a full file's
optimizer state, the prefixes of peft's adapters and the keys of ``lightning_zero.grad_norm``, are those of the
unwrapped model. A checkpoint saved with a policy loads without one and the reverse, and a DDP checkpoint loads into
either.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from lightning_zero.compat import (
    CHECKPOINT_WRAPPER_PREFIX,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from lightning_zero.config import CheckpointingPolicy
from lightning_zero.config_checks import check_classes_exist, class_matches

_WRAPPED_SEGMENT = CHECKPOINT_WRAPPER_PREFIX.rstrip(".")


def state_dict_name(name: str) -> str:
    """``name`` (from ``named_parameters()`` or ``named_modules()``) as ``state_dict()`` keys it: without the
    segments checkpoint wrappers add (Note [checkpoint wrappers keep the names])."""
    if _WRAPPED_SEGMENT not in name:
        return name
    return ".".join(segment for segment in name.split(".") if segment != _WRAPPED_SEGMENT)


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Every parameter of ``module`` by ``id``, named as ``state_dict()`` keys it (Note [checkpoint wrappers keep
    the names]); a tied parameter by its first name, as ``named_parameters()`` gives it."""
    return {id(p): state_dict_name(name) for name, p in module.named_parameters()}


def checkpointing_predicate(policy: CheckpointingPolicy, root: nn.Module) -> Callable[[nn.Module], bool]:
    """``policy`` as a predicate on modules; a class (or class name) that is no module of ``root`` is refused: it
    would checkpoint nothing, silently."""
    if not isinstance(policy, tuple):
        return policy
    classes = tuple(c for c in policy if isinstance(c, type))
    names = tuple(c for c in policy if isinstance(c, str))
    check_classes_exist(root, names, "activation_checkpointing_policy", "or module classes, or a callable")
    absent = [c.__name__ for c in classes if not any(isinstance(m, c) for m in root.modules())]
    if absent:
        raise ValueError(
            f"Invalid ZeroConfig.activation_checkpointing_policy: {absent} is no module class of {type(root).__name__}"
            ", so nothing would be checkpointed. HINT: name the classes of the layers to checkpoint (a transformer's "
            "blocks), or pass a callable `(module) -> bool`."
        )
    return lambda module: isinstance(module, classes) or class_matches(module, names)


def apply_activation_checkpointing_policy(root: nn.Module, policy: CheckpointingPolicy | None) -> int:
    """Wrap every module of ``root`` (not ``root`` itself) that ``policy`` selects in torch's non-reentrant checkpoint
    wrapper, in place; returns how many were wrapped.

    Call it before stage 3 forms its units (``shard_module``): a wrapped layer then becomes a unit as the layer would
    have. Idempotent: a model whose wrappers a policy made here is left as it is (a second ``setup`` of the same
    model). A model that already holds checkpoint wrappers of its own, even around the very layers the policy
    selects, is left as it is too, with a warning, as FSDP's strategies do.
    """
    if policy is None:
        return 0
    selects = checkpointing_predicate(policy, root)
    wrappers = [m for m in root.modules() if isinstance(m, CheckpointWrapper)]
    if wrappers:
        theirs = [w for w in wrappers if not getattr(w, _MADE_BY_POLICY, False)]
        if theirs:
            warnings.warn(
                f"ZeroConfig.activation_checkpointing_policy is set, but {type(root).__name__} already holds "
                f"checkpointed layers ({len(theirs)}, e.g. {type(theirs[0]._checkpoint_wrapped_module).__name__}): "
                "the policy is not applied. HINT: use either the policy or your own checkpoint wrappers.",
                UserWarning,
                stacklevel=2,
            )
        return 0
    apply_activation_checkpointing(root, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=selects)
    made = [m for m in root.modules() if isinstance(m, CheckpointWrapper)]
    for wrapper in made:
        setattr(wrapper, _MADE_BY_POLICY, True)
    return len(made)


_MADE_BY_POLICY = "_lightning_zero_policy"
"""Marks the checkpoint wrappers a policy made here, told apart from a model's own."""
