"""Split a module's parameters into the usual two optimizer groups: weight-decayed and not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def param_groups_with_weight_decay(
    module: nn.Module,
    weight_decay: float,
    *,
    decay_overrides: Mapping[str, Any] | None = None,
    no_decay_overrides: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Optimizer param groups: ``"decay"`` (matrices and embeddings, i.e. dim >= 2) and ``"no_decay"`` (biases and
    norm weights, which weight decay would only pull towards zero without regularizing anything useful).

    Each group carries its own ``weight_decay`` plus a ``name`` (kept by torch optimizers as an extra key), and the
    optional ``*_overrides`` hyper-parameters (e.g. ``{"lr": 1e-4}``) so tests can give the groups different settings.
    Frozen parameters are skipped, a Parameter shared by several modules appears once, and an empty group is
    dropped (torch optimizers reject groups without parameters).
    """
    if weight_decay < 0:
        raise ValueError(f"Invalid weight_decay: {weight_decay!r}. Expected a non-negative float.")
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [
        {
            "name": "decay",
            "params": [p for p in trainable if p.dim() >= 2],
            "weight_decay": weight_decay,
            **(decay_overrides or {}),
        },
        {
            "name": "no_decay",
            "params": [p for p in trainable if p.dim() < 2],
            "weight_decay": 0.0,
            **(no_decay_overrides or {}),
        },
    ]
    return [group for group in groups if group["params"]]
