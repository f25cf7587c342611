"""A small multi-layer perceptron: the cheapest model with both weight matrices and bias/norm vectors."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor, nn


class MLP(nn.Module):
    """``in_features -> [Linear -> LayerNorm -> GELU] per hidden width -> Linear -> out_features``.

    Uses torch's default layer initialization. ``reset_parameters()`` redraws it in construction order, so a model
    built on ``meta``, materialized with ``to_empty()`` and reset matches a model built directly under the same seed.
    """

    def __init__(
        self,
        *,
        in_features: int,
        hidden: Sequence[int] = (64, 64),
        out_features: int,
        bias: bool = True,
        layer_norm: bool = True,
    ) -> None:
        super().__init__()
        widths = [in_features, *hidden, out_features]
        if any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in widths):
            raise ValueError(
                f"Invalid MLP sizes: in_features={in_features!r}, hidden={tuple(hidden)!r}, "
                f"out_features={out_features!r}. Expected positive integers."
            )
        layers: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(widths[:-1]):
            layers.append(nn.Linear(width_in, width_out, bias=bias))
            if layer_norm:
                layers.append(nn.LayerNorm(width_out, bias=bias))
            layers.append(nn.GELU())
        layers.append(nn.Linear(widths[-2], widths[-1], bias=bias))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for layer in self.net:
            if isinstance(layer, nn.Linear | nn.LayerNorm):
                layer.reset_parameters()
