"""``DynamicLossScaler``: fp16 loss scaling whose skip decision is the same on every rank.

fp16 gradients underflow unless the loss is scaled up before backward; the scale is lowered whenever a gradient
overflows (that step is skipped) and raised again after a run of good steps. Under ZeRO each rank sees only its shard
of the gradients, so one rank can overflow while another does not: the overflow flag is summed across ranks before
the decision (``ZeroOptimizer.reduce_gradients``), so every rank skips the same steps and keeps the same scale.

Note [one loss scale per optimizer]
Each optimizer has its own ``DynamicLossScaler``, updated once per step of that optimizer from its own gradients,
so with several optimizers (manual optimization: a GAN's generator and discriminator) each scale grows and backs
off exactly as it would for that optimizer alone. A backward pass does not know which optimizer its gradients are
for, so it multiplies the loss by the smallest of the scales (``scale_for_backward``), and every optimizer divides
its gradients by the scale they were produced with (``gradient_scale``) rather than by its own. That scale is fixed
while any optimizer holds gradients not yet stepped (or zeroed), so gradients accumulated over several backward
passes all carry the same factor; it is decided from backward, step and ``zero_grad`` calls alone, which every rank
makes in the same order, so every rank scales by the same factor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DynamicLossScaler:
    """The scale and its schedule (the defaults are ``torch.amp.GradScaler``'s)."""

    scale: float = 2.0**16
    """Factor the loss is multiplied by before backward."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after ``growth_interval`` steps in a row without overflow."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this on every overflow (the step is skipped)."""
    growth_interval: int = 2000
    """Good steps in a row before the scale grows."""
    _good_steps: int = field(default=0, repr=False)
    gradient_scale: float | None = field(default=None, repr=False, compare=False)
    """The factor the gradients produced since this optimizer's last step carry (Note [one loss scale per
    optimizer]); None: none produced yet, they will carry ``scale``."""

    @property
    def scale_of_gradients(self) -> float:
        """What the current gradients must be divided by."""
        return self.scale if self.gradient_scale is None else self.gradient_scale

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"Invalid DynamicLossScaler.scale: {self.scale!r}. Expected a positive number.")
        if not self.growth_factor > 1:
            raise ValueError(f"Invalid DynamicLossScaler.growth_factor: {self.growth_factor!r}. Expected > 1.")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"Invalid DynamicLossScaler.backoff_factor: {self.backoff_factor!r}. Expected in (0, 1).")
        if self.growth_interval < 1:
            raise ValueError(f"Invalid DynamicLossScaler.growth_interval: {self.growth_interval!r}. Expected >= 1.")

    def update(self, found_inf: bool) -> None:
        """After a step decision agreed by all ranks: back off on overflow, grow after enough good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])


def scale_for_backward(scalers: Sequence[DynamicLossScaler]) -> float:
    """The factor the next backward multiplies the loss by, recorded on every scaler (Note [one loss scale per
    optimizer])."""
    pending = next((s.gradient_scale for s in scalers if s.gradient_scale is not None), None)
    scale = pending if pending is not None else min(s.scale for s in scalers)
    for scaler in scalers:
        scaler.gradient_scale = scale
    return scale
