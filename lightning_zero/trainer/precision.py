"""``ZeroPrecision``: the precision plugin ``ZeroStrategy`` installs in place of Lightning's: ZeRO's precision
(``ParameterPrecision``, ``engine/precision.py``) with the Trainer's clipping hooks, and ``.grad`` shown to
``on_before_optimizer_step`` hooks (Note [gradients visible to hooks] in ``engine/sharded_gradient.py``).

Note [reduced gradients live in the optimizer]
After backward, a parameter's ``.grad`` does not hold the averaged gradient: stage 1 has already reduce-scattered its
flat gradient buffers into the sharded optimizer (and sets ``.grad`` to None: Note [no partial gradients] in
``engine/grad_norm.py``), stages 2 and 3 keep only this rank's shard and leave ``.grad`` empty. The reduced gradients
are the ``ZeroOptimizer``'s master gradients; ``on_before_optimizer_step`` hooks read them through ``.grad`` (Note
[gradients visible to hooks] in ``engine/sharded_gradient.py``), and nothing else does. So clipping must go through
Lightning (``Trainer(gradient_clip_val=...)``, or ``self.clip_gradients(...)`` inside ``configure_gradient_clipping`` or
a manual ``training_step``), which lands in ``ZeroOptimizer.clip_grad_*`` and clips by the global norm across shards;
``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` in ``configure_gradient_clipping`` finds no gradients and
clips nothing (in ``on_before_optimizer_step`` it is refused: a write to a gradient the step never reads). We cannot see
such a call, so a ``configure_gradient_clipping`` that never clipped through Lightning during a fit is named in a
warning when the fit ends.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_zero.engine.precision import ParameterPrecision, ZeroPrecisionName
from lightning_zero.engine.precision import to_zero_precision as translate
from lightning_zero.sharding.loss_scaler import DynamicLossScaler
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.trainer.visible_gradients import VisibleGradients


class ZeroPrecision(ParameterPrecision):
    """ZeRO's precision under the Trainer (``Trainer(strategy="zero*", precision=...)``, or in ``plugins``):
    parameters in ``param_dtype``; fp32 masters unless ``-true``; dynamic loss scaling for ``16-mixed``."""

    _strategy_name = "ZeroStrategy"
    _front_door = "Trainer"

    def __init__(self, precision: ZeroPrecisionName = "32-true", loss_scaler: DynamicLossScaler | None = None) -> None:
        super().__init__(precision, loss_scaler)
        # A user's `configure_gradient_clipping` during this fit: its class, calls, and calls that clipped through
        # Lightning. See Note [reduced gradients live in the optimizer].
        self._clipping_hook: tuple[str, int, int] | None = None
        self._clipped = False
        self._visible_gradients = VisibleGradients()  # Note [gradients visible to hooks]

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Lightning reads 0 as "no clipping" (it was the Trainer's default) but also ignores a negative or NaN value
        # without a word; such a value is a mistake, and training unclipped would hide it.
        if not clip_val >= 0:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm).value
            raise ValueError(
                f"Invalid gradient clip value {clip_val!r} for clipping by {algorithm}. Expected a positive number "
                "(or 0, which disables clipping). HINT: fix `Trainer(gradient_clip_val=...)` or the value passed to "
                "`self.clip_gradients(...)`; None disables clipping too."
            )
        self._clipped = True
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        # `.grad` shows the reduced gradients to the on_before_optimizer_step hooks: Note [gradients visible to hooks]
        zero = (getattr(o, "_optimizer", o) for o in model.trainer.optimizers)
        self._visible_gradients.show(model, [o for o in zero if isinstance(o, ZeroOptimizer)])
        try:
            super()._after_closure(model, optimizer)  # the hooks, then _clip_gradients
        finally:
            self._visible_gradients.hide()

    @override
    def _clip_gradients(
        self,
        model: pl.LightningModule | nn.Module,
        optimizer: Any,
        clip_val: int | float | None = None,
        gradient_clip_algorithm: GradClipAlgorithmType | None = None,
    ) -> None:
        self._visible_gradients.hide()  # clipping hooks keep Note [no partial gradients]'s None
        self._clipped = False
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)  # calls the user's hook
        # Lightning calls the hook in automatic optimization only.
        hooked = isinstance(model, pl.LightningModule) and model.automatic_optimization
        if hooked and is_overridden("configure_gradient_clipping", model):
            _, calls, clipped = self._clipping_hook or ("", 0, 0)
            self._clipping_hook = (type(model).__name__, calls + 1, clipped + self._clipped)

    @override
    def teardown(self) -> None:
        # Only after the fit: a hook that clips conditionally (say, after warm-up) skips some steps on purpose.
        if self._clipping_hook is not None and self._clipping_hook[2] == 0:
            name, calls, _ = self._clipping_hook
            rank_zero_warn(
                f"`{name}.configure_gradient_clipping` ran {calls} times and never clipped through Lightning. Under "
                "ZeroStrategy the parameters' `.grad` do not hold the reduced gradients (Note [reduced gradients "
                "live in the optimizer] in lightning_zero/trainer/precision.py), so clipping them directly, e.g. "
                "`torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`, clipped nothing. HINT: call "
                "`self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...)` in the hook."
            )
        self._clipping_hook = None
        super().teardown()

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        _zero_optimizer(optimizer).clip_grad_norm_(clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        _zero_optimizer(optimizer).clip_grad_value_(clip_val)


def _zero_optimizer(optimizer: Any) -> ZeroOptimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer in manual optimization
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"ZeroPrecision clips gradients of a ZeroOptimizer, got {type(optimizer).__name__}.")
    return optimizer


def to_zero_precision(plugin: FabricPrecision | None) -> ZeroPrecision:
    """Translate the plugin Lightning built from ``Trainer(precision=...)`` into ZeRO's own (or refuse it)."""
    return translate(plugin, ZeroPrecision)
