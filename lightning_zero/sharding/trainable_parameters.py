"""``TrainableParameters``: which parameters an optimizer trains, decided once when ``ZeroOptimizer`` shards it.

Which parameters are reduced, sharded and stepped is fixed at setup: the flat buckets, the segments and the masters
are built over the parameters that required a gradient then. A parameter (un)frozen later is refused at the next
step rather than silently mishandled.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from lightning_zero.sharding.activation_checkpointing import parameter_names


class TrainableParameters:
    """The ``requires_grad`` of each of an optimizer's parameters when ``ZeroOptimizer`` sharded it."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self._requires_grad = [(p, p.requires_grad) for p in params]

    def check(self, module: nn.Module, optimizer_name: str) -> None:
        """Refuse a parameter (un)frozen since construction: DDP raises for a parameter that stops getting gradients;
        we would step it with zero gradients (weight decay, momentum), or never step one unfrozen later."""
        changed = next((p for p, trainable in self._requires_grad if p.requires_grad != trainable), None)
        if changed is None:
            return
        name = parameter_names(module)[id(changed)]
        was, now = ("frozen", "trainable") if changed.requires_grad else ("trainable", "frozen")
        raise RuntimeError(
            f"Parameter {name!r} was {was} when ZeroOptimizer sharded {optimizer_name} and is {now} "
            "now. ZeRO decides once, at setup, which parameters it reduces, shards and steps: a parameter unfrozen "
            "later would never be stepped, one frozen later would keep its place in every reduction. HINT: set "
            "`requires_grad` before training starts (in `__init__` or "
            "`configure_model`); to train parts of a model in turn, give each part its own optimizer and use "
            "`toggle_optimizer`."
        )
